"""Carrying on a group of choices (`n`, chat tool calls, echo): each framed delta is logged as a step (its
choice, tokens and finish) with the event it went out with, and a carried group that replays the logged
steps through the same framing, then goes live in other chunks, sends what an undisturbed group sends."""

from __future__ import annotations

import json
import random
from contextlib import AsyncExitStack
from dataclasses import dataclass

import pytest

from common.priorities import Priority
from gateway.flow.carried import choice_steps, replayed_then_live
from gateway.flow.choices import GenerationGroup, group_sse
from gateway.flow.generation import Generation, Prepared
from gateway.flow.served_model import ServedModel
from gateway.openai.bodies import ResponseShape, Usage
from gateway.openai.schemas import parse_chat, parse_completion
from gateway.streams.carry_on import read_logged
from gateway.streams.carry_record import CarryRecord
from gateway.streams.event_log import EventLogs, log_key
from gateway.streams.resumable import ResumableStream
from tenancy.redis_client import async_client
from tests.tool_data import ASK, TOOLS
from worker.protocol import OutItem

CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "C"}}\n'
        "</tool_call>")


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return ServedModel.load("default")


@pytest.fixture()
async def client(redis_url):
    redis = async_client(redis_url)
    yield redis
    await redis.aclose()


@dataclass(slots=True)
class Tenant:
    name: str = "acme"


def prepared(model: ServedModel, body: dict) -> Prepared:
    req = (parse_chat if "messages" in body else parse_completion)(body)
    shape = ResponseShape("chatcmpl-" + "a" * 32, 1764374400, "default", req.kind == "chat")
    ids = model.encode(req).ids
    batch = [model.encode_prompt(pr).ids for pr in req.prompts or []] if _many(req) else []
    return Prepared("req-1", req, Tenant(), ids, None, 64, Priority.INTERACTIVE, b"ns", shape,  # type: ignore
                    batch)


def _many(req: object) -> bool:
    return len(getattr(req, "prompts", None) or []) > 1


async def chunked(tokens: list[int], rng: random.Random) -> object:
    """A worker's stream of `tokens` in random chunks, ending with `stop`."""
    at = 0
    while at < len(tokens):
        n = rng.randint(1, 4)
        yield OutItem("r", tokens[at:at + n], "stop" if at + n >= len(tokens) else None, 0, None)
        at += n


def group(model: ServedModel, p: Prepared, streams: list, order: list[int] | None = None) -> GenerationGroup:
    usage = Usage(prompt_tokens=sum(map(len, p.prompts)))
    gens = [Generation(model, p, s, AsyncExitStack(), usage, {}, 10.0) for s in streams]
    return GenerationGroup(p, gens, AsyncExitStack(), usage, {}, replay=order or [])


async def sse_of(g: GenerationGroup) -> list[bytes]:
    events = g.events()
    out = [e async for e in group_sse(g, await anext(events, None), events)]
    await g.close()
    return out


def merged(events: list[bytes]) -> dict:
    """Per choice: its content, its tool calls' names and arguments, its finish reason."""
    out: dict = {}
    for e in events:
        data = e.removeprefix(b"data: ").strip()
        if data == b"[DONE]":
            continue
        for c in json.loads(data)["choices"]:
            got = out.setdefault(c["index"], {"text": "", "calls": {}, "finish": None})
            delta = c.get("delta", c)
            got["text"] += delta.get("content") or delta.get("text") or ""
            for call in delta.get("tool_calls") or []:
                one = got["calls"].setdefault(call["index"], ["", ""])
                one[0] += call.get("function", {}).get("name") or ""
                one[1] += call.get("function", {}).get("arguments") or ""
            got["finish"] = c["finish_reason"] or got["finish"]
    return out


@pytest.mark.parametrize("body", [
    {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "n": 2},
    {"messages": ASK, "n": 3},
    {"prompt": ["Tell me", "a story"], "n": 2, "echo": True},
], ids=["tool-calls-n2", "chat-n3", "completions-two-prompts-echo"])
async def test_a_carried_group_replays_its_logged_steps_and_sends_what_an_undisturbed_one_does(
        client, model, body):
    p = prepared(model, {"model": "default", "stream": True, "stream_options": {"include_usage": True},
                         **body})
    outputs = [model.tokenizer.encode(CALL if p.req.tools else f"choice {i} says héllo wörld " * 3)
               for i in range(p.choices)]
    rng = random.Random(7)
    whole = await sse_of(group(model, p, [chunked(t, rng) for t in outputs]))
    logs = EventLogs(client, flush_s=0.005)
    first = group(model, p, [chunked(t, rng) for t in outputs])
    record = CarryRecord("chat", b"{}", "acme", "", "chatcmpl-g", 1, "req-1", 0, grouped=True)
    stream = ResumableStream(logs, "acme", "chatcmpl-g", _first_events(first, len(whole) // 2), _nothing,
                             source=first, carry=record.encode())
    part = _split(b"".join([e async for e in stream.body()]))
    await stream.close()
    await logs.flush()
    entries = await client.xrange(log_key("acme", "chatcmpl-g"))
    logged = read_logged([e for e in entries if b"end" not in e[1]], grouped=True)
    assert logged is not None and logged.events == len(part) == len(whole) // 2
    steps = choice_steps(logged.tokens, logged.codes, logged.choices, p.choices)
    live = [t[sum(len(s[0]) for s in st):] for t, st in zip(outputs, steps, strict=True)]
    carried = group(model, p, [replayed_then_live("r", st, 0, 64, _live(rest, random.Random(i)))
                               for i, (st, rest) in enumerate(zip(steps, live, strict=True))], logged.choices)
    rest = (await sse_of(carried))[logged.events:]
    assert merged(_bare(part) + rest) == merged(whole)  # text, tool calls and finish of every choice
    assert len(merged(whole)) == p.choices and all(c["finish"] == ("tool_calls" if p.req.tools else "stop")
                                                   for c in merged(whole).values())
    assert json.loads(rest[-2].removeprefix(b"data: "))["usage"] == json.loads(
        whole[-2].removeprefix(b"data: "))["usage"]  # usage counted once, whole
    await logs.close()


async def _nothing() -> None:
    return None


async def _first_events(g: GenerationGroup, n: int):
    """The first `n` SSE events of a group (its gateway is lost after them)."""
    events = g.events()
    body = group_sse(g, await anext(events, None), events)
    for _ in range(n):
        yield await anext(body)
    await body.aclose()


def _live(tokens: list[int], rng: random.Random):
    return lambda: chunked(tokens, rng)


def _split(body: bytes) -> list[bytes]:
    return [part + b"\n\n" for part in body.split(b"\n\n")[:-1]]


def _bare(framed: list[bytes]) -> list[bytes]:
    """The events without their id lines."""
    return [b"\n".join(line for line in event.split(b"\n") if not line.startswith(b"id: "))
            for event in framed]



def test_a_grouped_record_names_itself_and_a_single_one_reads_as_before():
    single = CarryRecord("chat", b'{"n": 1}', "acme", "", "chatcmpl-s", 1, "req-1", 0)
    grouped = CarryRecord("completions", b'{"n": 2}', "acme", "", "cmpl-g", 1, "req-1", 0, grouped=True)
    assert b"grouped" not in single.encode() and CarryRecord.decode(single.encode()) == single
    assert CarryRecord.decode(grouped.encode()) == grouped


def test_logged_steps_split_per_choice_and_a_step_naming_no_choice_is_refused():
    steps = choice_steps([1, 2, 3, 4, 5], [2 * 4, 1 * 4, 2 * 4 + 1, 0 * 4 + 2], [1, 0, 1, 0], 2)
    assert steps == [[([3], None), ([], "length")], [([1, 2], None), ([4, 5], "stop")]]
    with pytest.raises(ValueError):
        choice_steps([1], [4], [2], 2)
