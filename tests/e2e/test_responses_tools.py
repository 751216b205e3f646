"""Function tools on `POST /v1/responses` through the official `openai` SDK against the shared real stack:
forced calls come back as `function_call` items whose arguments validate, streamed as typed, numbered events;
a tool round trip continues with `previous_response_id` + `function_call_output` (and renders the same as the
turns sent whole); tool errors are 400s naming their field."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.tool_data import ASK, SCHEMAS, TOOLS

# flat, as the Responses API takes
RTOOLS = [{"type": "function", **t["function"], "strict": True} for t in TOOLS]
QUESTION = ASK[0]["content"]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=stack.key, base_url=stack.base_url + "/v1", max_retries=0, timeout=120)


def _forced(client: openai.OpenAI, choice: object = "required", **kw):
    return client.responses.create(model="default", input=QUESTION, tools=RTOOLS, tool_choice=choice,
                                   parallel_tool_calls=False, max_output_tokens=90, temperature=0, **kw)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}],
                         ids=["required", "named"])
def test_a_forced_call_is_a_function_call_item(client, choice):
    resp = _forced(client, choice)
    assert resp.status == "completed" and len(resp.output) == 1
    call = resp.output[0]
    assert call.type == "function_call" and call.status == "completed"
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.call_id) and call.id == "fc_" + call.call_id[5:]
    assert call.name in SCHEMAS and (choice == "required" or call.name == "get_time")
    assert SCHEMAS[call.name].is_valid(json.loads(call.arguments))
    assert [t.name for t in resp.tools] == ["get_weather", "get_time"] and resp.parallel_tool_calls is False
    if choice == "required":
        assert resp.tool_choice == "required"
    else:
        assert resp.tool_choice.type == "function" and resp.tool_choice.name == "get_time"
    assert resp.output_text == ""


def test_streamed_call_events_are_typed_numbered_and_whole(client):
    events = list(_forced(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.status == "in_progress" and added.arguments == ""
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and all(d.item_id == added.id and d.output_index == 0 for d in deltas)
    arguments = "".join(d.delta for d in deltas)
    assert events[-3].arguments == arguments == done.arguments
    final = events[-1].response
    assert final.output[0].call_id == added.call_id == done.call_id and final.output[0].arguments == arguments
    assert SCHEMAS[done.name].is_valid(json.loads(arguments))
    assert client.responses.retrieve(final.id).output[0].arguments == arguments  # stored with its call


def test_tool_round_trip_with_previous_response_id(client):
    first = _forced(client)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}
    second = client.responses.create(model="default", previous_response_id=first.id, input=[result],
                                     tools=RTOOLS, tool_choice="none", max_output_tokens=8, temperature=0)
    assert second.output[0].type == "message" and second.tool_choice == "none"
    alone = client.responses.create(model="default", input=QUESTION, tools=RTOOLS, tool_choice="none",
                                    max_output_tokens=1)
    assert second.usage.input_tokens > alone.usage.input_tokens + 20  # the call and its result were rendered
    (item,) = client.responses.input_items.list(second.id).data
    assert (item.type == "function_call_output" and item.call_id == call.call_id
            and item.output == result["output"])
    # the same turns sent whole: the call item as the SDK returned it, then its output
    whole = client.responses.create(model="default", input=[{"role": "user", "content": QUESTION},
                                                            call.model_dump(exclude_none=True), result],
                                    tools=RTOOLS, tool_choice="none", max_output_tokens=8, temperature=0)
    assert whole.usage.input_tokens == second.usage.input_tokens


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": RTOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "x", "parameters": {"type": "nope"}}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "x", "frobnicate": 1}]}, "tools[0].frobnicate"),
    ({"tools": RTOOLS, "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_tool_errors_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="default", max_output_tokens=5, **{"input": QUESTION, **extra})
    assert err.value.body["param"] == param, err.value.body
