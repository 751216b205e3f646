"""Tool calls through the official `openai` SDK against a real gateway, Redis and worker (tiny random model,
default tokenizer): forced calls validate for every seed, a tool result is accepted in a second turn, `auto`
and `none`, and bad input is a 400 that charges one request of rpm (no tokens)."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.gateway_stack import charged_as_invalid, tenant_state
from tests.tool_data import ASK, SCHEMAS, TOOLS

pytestmark = pytest.mark.timeout(240)  # the first test also starts the tools_stack
SEEDS = range(20)


def _call(tools_client: openai.OpenAI, seed: int, stream: bool, choice: object) -> tuple[list[dict], str]:
    kw = {"model": "default", "messages": ASK, "temperature": 1.0, "seed": seed, "max_tokens": 90,
          "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
    if not stream:
        resp = tools_client.chat.completions.create(**kw)
        msg = resp.choices[0].message
        assert msg.content is None
        return [c.model_dump() for c in msg.tool_calls or []], resp.choices[0].finish_reason
    calls: dict[int, dict] = {}
    finish = None
    for chunk in tools_client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content, c.delta
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "type": d.type,
                                                  "function": {"name": d.function.name, "arguments": ""}})
                call["function"]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_call_validates_for_every_seed(tools_client, choice):
    jobs = [(seed, seed % 2 == 1) for seed in SEEDS]  # 20 seeds, half of them streamed
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent, so the worker batches them
        results = list(pool.map(lambda job: _call(tools_client, job[0], job[1], choice), jobs))
    for (seed, stream), (calls, finish) in zip(jobs, results, strict=True):
        assert finish == "tool_calls" and len(calls) == 1, (seed, stream, calls, finish)
        call = calls[0]
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
        name = call["function"]["name"]
        assert name in SCHEMAS and (isinstance(choice, str) or name == "get_weather")
        assert SCHEMAS[name].is_valid(json.loads(call["function"]["arguments"])), (seed, stream, call)
    assert len({json.dumps(c) for c, _ in results}) > 5  # temperature 1.0 really samples


def test_tool_result_in_a_second_turn_is_accepted(tools_client):
    first = tools_client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                                 tool_choice="required", parallel_tool_calls=False,
                                                 max_tokens=90, seed=3, temperature=1.0)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high_c": 21}'}]
    second = tools_client.chat.completions.create(model="default", messages=turns, tools=TOOLS,
                                                  tool_choice="none", max_tokens=8, temperature=0)
    assert second.choices[0].message.tool_calls is None
    alone = tools_client.chat.completions.create(model="default", messages=ASK, max_tokens=1)
    # the call and its result were rendered
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_auto_and_none(tools_client):
    resp = tools_client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=60,
                                                seed=1, temperature=1.0, n=4)
    for c in resp.choices:
        if c.message.tool_calls:  # a call, if any, is well formed; otherwise plain text
            assert c.message.content is None
            for call in c.message.tool_calls:
                if c.finish_reason == "tool_calls":
                    assert SCHEMAS[call.function.name].is_valid(json.loads(call.function.arguments))
        else:
            assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)
    none = tools_client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                                tool_choice="none", max_tokens=5, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


BAD = [
    ({"n": 9}, "n"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_and_charges_one_request(tools_stack, extra, param):
    gs = tools_stack[0]
    name = "bad-" + re.sub(r"[^a-z0-9]", "", param) + "-" + os.urandom(3).hex()  # two cases share a param
    key = gs.stack.create_tenant(name)
    sdk = openai.OpenAI(api_key=key, base_url=gs.base_url + "/v1", max_retries=0, timeout=60)
    before = tenant_state(gs.stack.redis_url, name)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="default", messages=ASK, max_tokens=5, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
    # one request of rpm; no tokens, lease or usage
    assert charged_as_invalid(gs.stack.redis_url, name, before)


@pytest.mark.parametrize(("extra", "param"), [({"best_of": 9}, "best_of"),
                                              ({"n": 2, "best_of": 2}, "best_of"),
                                              ({"echo": True, "logprobs": 2}, "echo"),
                                              ({"prompt": ["a", 5]}, "prompt[1]")])
def test_bad_completion_input_is_400(tools_client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        tools_client.completions.create(model="default", max_tokens=5, **{"prompt": "x", "extra_body": extra})
    assert err.value.body["param"] == param
