"""Streams of several choices, tool calls and echo outlive their gateway: two real gateways (dollar budgets
on) over one `tiny-random` worker (fp32, greedy) and Redis.

Five streams start on gateway A: chat with `n=2`, a chat tool call (`tool_choice: required`), a completion
with `echo`, a completion of two prompts with `n=2`, and a response's tool call. Once each has sent some
events, A is SIGKILLed; each client reconnects to gateway B (`Last-Event-ID`; the response with
`starting_after`) and gets the events it missed, then the live tail: per choice the text, tool calls and
finish of an undisturbed run, with event ids unbroken (a call's ids the same on both sides of the seam) and
the usage of an undisturbed run, metered once, its token leases and dollar holds settled once (the spend
exact)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from admission.money.hierarchy import assign_project, read_balance, set_budget
from admission.money.prices import set_price
from tenancy.schema import leases_key
from tests.faults.cluster import FaultCluster, gateway_log_records, unattributed_errors
from tests.faults.test_stream_reconnect import read, read_until_cut, sse, usage_today

# two gateways and a worker, one of them killed: a long multi-process scenario, `make test-heavy`
pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]
STORY = {"type": "function", "function": {"name": "write_story", "parameters": {
    "type": "object", "properties": {"story": {"type": "string", "minLength": 160, "maxLength": 400}},
    "required": ["story"], "additionalProperties": False}}}
GREEDY = {"model": "default", "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
ASK = [{"role": "user", "content": "Tell me a story."}]
STREAMS = {  # name: (path, body)
    "chat n=2": ("/v1/chat/completions", {**GREEDY, "messages": ASK, "n": 2, "max_tokens": 150,
                                          "ignore_eos": True}),
    "tool call": ("/v1/chat/completions", {**GREEDY, "messages": ASK, "tools": [STORY],
                                           "tool_choice": "required", "parallel_tool_calls": False,
                                           "max_tokens": 300}),
    "echo": ("/v1/completions", {**GREEDY, "prompt": "Once upon a time", "echo": True, "max_tokens": 150,
                                 "ignore_eos": True}),
    "two prompts n=2": ("/v1/completions", {**GREEDY, "prompt": ["Tell me a story.", "Once upon a time"],
                                            "n": 2, "max_tokens": 100, "ignore_eos": True}),
}
RESPONSE = {"model": "default", "input": "Tell me a story.", "temperature": 0, "stream": True,
            "tools": [{"type": "function", **STORY["function"]}], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 300}
SEEN_BEFORE_KILL = 8  # events each client reads from A


@pytest.fixture(scope="module")
def cluster() -> Iterator[FaultCluster]:
    c = FaultCluster.start(workers=1, gateways=2, worker_args=("--no-prefix-cache",),
                           gateway_settings={"stream_detach_grace": 30, "money_budgets": True})
    yield c
    c.stop()


def merged(events: list) -> tuple[dict, dict | None]:
    """Per choice: its text (content or completion text), its tool calls (name, arguments, ids sent) and
    finish reason; and the usage."""
    out: dict = {}
    usage = None
    for _, _, data in events:
        if data == "[DONE]":
            continue
        obj = json.loads(data)
        assert "error" not in obj, obj
        usage = obj.get("usage") or usage
        for c in obj["choices"]:
            got = out.setdefault(c["index"], {"text": "", "calls": {}, "finish": None})
            delta = c.get("delta", c)
            got["text"] += delta.get("content") or delta.get("text") or ""
            for call in delta.get("tool_calls") or []:
                one = got["calls"].setdefault(call["index"], {"name": "", "arguments": "", "ids": []})
                one["ids"] += [call["id"]] if call.get("id") else []
                one["name"] += call.get("function", {}).get("name") or ""
                one["arguments"] += call.get("function", {}).get("arguments") or ""
            got["finish"] = c["finish_reason"] or got["finish"]
    return out, usage


def without_ids(choices: dict) -> dict:
    """Tool call ids are random per run: everything else of an undisturbed run is the same."""
    return {i: {**c, "calls": {k: {**v, "ids": len(v["ids"])} for k, v in c["calls"].items()}}
            for i, c in choices.items()}


def response_call(events: list) -> tuple[dict, set[str]]:
    """A response stream's final event's function call (ids aside), and every item id its events name."""
    final = json.loads(events[-1][2])
    assert final["type"] == "response.completed", final
    (call,) = final["response"]["output"]
    names = {call["id"]}
    for _, _, data in events:
        obj = json.loads(data)
        names |= {obj.get("item_id"), (obj.get("item") or {}).get("id")} - {None}
    return {k: call[k] for k in ("type", "name", "arguments", "status")}, names


def test_streams_of_choices_tool_calls_and_echo_are_carried_on_after_a_sigkill(cluster: FaultCluster):
    a, b = cluster.gateways
    key = cluster.create_tenant("groups")
    r = redis.Redis.from_url(cluster.redis.url)
    assign_project(r, "groups", "acme")
    set_price(r, "*", "0", None, "1000")  # 1,000 micro-dollars an output token, input free
    set_budget(r, "acme", "organization", "acme", "100", "day")
    time.sleep(1.1)  # every gateway's 1 s view of prices and organizations
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=120) as http:
        whole = {name: merged(read(http, "POST", b.base_url + path, key, body=body))
                 for name, (path, body) in STREAMS.items()}
        whole_response = read(http, "POST", b.base_url + "/v1/responses", key, body=RESPONSE)
        before, spent = usage_today(cluster, "groups"), read_balance(r, "acme", "organization", "acme")
        parts: dict[str, list] = {}
        with contextlib.ExitStack() as stack:
            opened = {name: stack.enter_context(http.stream("POST", a.base_url + path, json=body,
                                                            headers=auth))
                      for name, (path, body) in {**STREAMS, "response": ("/v1/responses", RESPONSE)}.items()}
            lines: dict[str, list[str]] = {name: [] for name in opened}
            its = {name: resp.iter_lines() for name, resp in opened.items()}
            for name, it in its.items():
                assert opened[name].status_code == 200
                while sum(x.startswith("data: ") for x in lines[name]) < SEEN_BEFORE_KILL:
                    lines[name].append(next(it))
            a.kill()
            for name, it in its.items():
                read_until_cut(it, lines[name])
                parts[name] = sse(lines[name])
        rests = {name: read(http, "POST", b.base_url + STREAMS[name][0], key,
                            headers={"last-event-id": parts[name][-1][0]}) for name in STREAMS}
        rid = json.loads(parts["response"][0][2])["response"]["id"]
        rests["response"] = read(http, "GET", f"{b.base_url}/v1/responses/{rid}?stream=true"
                                 f"&starting_after={parts['response'][-1][0]}", key)
    events = parts["response"] + rests["response"]
    assert [int(e[0]) for e in events] == list(range(len(events)))
    (call, item_ids), (want, _) = response_call(events), response_call(whole_response)
    assert call == want and len(item_ids) == 1  # one function call item, named alike before and after
    for name in STREAMS:
        events = parts[name] + rests[name]
        assert [int(e[0].rpartition(":")[2]) for e in events] == list(range(len(events))), name
        assert events[-1][2] == "[DONE]", name
        choices, usage = merged(events)
        assert (without_ids(choices), usage) == (without_ids(whole[name][0]), whole[name][1]), name
    calls = merged(parts["tool call"] + rests["tool call"])[0][0]["calls"]
    assert [(c["name"], len(c["ids"])) for c in calls.values()] == [("write_story", 1)]  # its id sent once
    assert len(json.loads(calls[0]["arguments"])["story"]) >= 160
    assert all(len(whole[name][0]) == n for name, n in (("chat n=2", 2), ("two prompts n=2", 4)))
    assert all(c["text"].startswith("Once upon a time") for c in whole["echo"][0].values())
    tokens = sum(whole[name][1]["completion_tokens"] for name in STREAMS)
    tokens += json.loads(whole_response[-1][2])["response"]["usage"]["output_tokens"]
    after = usage_today(cluster, "groups")
    metered = {k: after[k] - before.get(k, 0) for k in ("requests", "completion_tokens")}
    assert metered == {"requests": len(STREAMS) + 1, "completion_tokens": tokens}  # once, by B
    deadline = time.monotonic() + 10
    while (balance := read_balance(r, "acme", "organization", "acme"))["held_micro"] \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert balance == {"spent_micro": spent["spent_micro"] + 1000 * tokens, "held_micro": 0}
    assert r.zcard(leases_key("groups")) == 0  # the lost gateway's leases are settled
    r.close()
    carried = [rec["msg"] for rec in gateway_log_records(b)[0] if "carrying on stream" in rec.get("msg", "")]
    assert len(carried) == len(STREAMS) + 1, carried  # B carried them on (they had not ended when A died)
    assert not unattributed_errors(b)
