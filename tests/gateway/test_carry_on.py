"""Carrying a lost gateway's stream on, its parts against a real Redis: the tokens each logged event was
made from, write-ahead (a client gets an event only once it is logged), the carry record, one claimer, the
groups the logged tokens are replayed in, and a stalled first gateway that stops once the stream is taken."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from gateway.flow.carried import groups, replayed_then_live
from gateway.streams.carry_on import CarryOn, read_logged
from gateway.streams.carry_record import CarryRecord, Lease
from gateway.streams.event_log import EventLogs, carry_key, log_key, owner_key
from gateway.streams.resumable import ResumableStream
from tenancy.redis_client import async_client


@pytest.fixture()
async def client(redis_url):
    redis = async_client(redis_url)
    yield redis
    await redis.aclose()


@dataclass
class FakeGeneration:
    """What a carried stream's log reads from a generation: the tokens it consumed and its finish."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


async def nothing() -> None:
    return None


def record(stream_id: str) -> CarryRecord:
    return CarryRecord("chat", b'{"model": "default", "messages": []}', "acme", "d" * 64, stream_id,
                       1764374400, "req-1", 5, Lease("lease-1", 10, 20))


async def tokens_then_events(gen: FakeGeneration, steps: list[tuple[list[int], str | None, int]]):
    """Each step: the generation consumes tokens (and maybe the finish), then yields `events` events."""
    for tokens, finish, events in steps:
        gen.token_ids += tokens
        gen.finish_reason = finish or gen.finish_reason
        for _ in range(events):
            yield b"data: {}\n\n"


async def test_each_event_logs_the_tokens_it_was_made_from_and_the_finish(client):
    logs, gen = EventLogs(client, flush_s=0.01), FakeGeneration()
    steps = [([1, 2], None, 1), ([], None, 1), ([3], None, 0), ([4, 5], None, 2), ([], "length", 1)]
    stream = ResumableStream(logs, "acme", "chatcmpl-a", tokens_then_events(gen, steps), nothing,
                             source=gen, carry=record("chatcmpl-a").encode())
    body = b"".join([chunk async for chunk in stream.body()])
    await stream.close()
    await logs.close()
    entries = await client.xrange(log_key("acme", "chatcmpl-a"))
    logged = read_logged([e for e in entries if b"end" not in e[1]])
    assert body.count(b"\n\n") == logged.events == 5
    assert logged.tokens == [1, 2, 3, 4, 5]
    assert groups(logged.tokens, logged.codes) == [([1, 2], None), ([3, 4, 5], None), ([], "length")]
    assert not await client.exists(carry_key("acme", "chatcmpl-a"))  # an ended stream's record goes


async def test_a_client_gets_an_event_only_once_it_is_logged(client):
    logs, gen = EventLogs(client, flush_s=0.2), FakeGeneration()
    body = tokens_then_events(gen, [([7], None, 1)] * 3)
    stream = ResumableStream(logs, "acme", "chatcmpl-w", body, nothing, source=gen,
                             carry=record("chatcmpl-w").encode())
    async for chunk in stream.body():
        seq = int(chunk.split(b"\n")[0].split(b": ")[1])
        entries = [e for e in await client.xrange(log_key("acme", "chatcmpl-w")) if b"s" in e[1]]
        assert entries and int(entries[-1][1][b"s"]) + entries[-1][1][b"d"].count(b"\n\n") > seq
    await stream.close()
    await logs.close()


async def test_the_carry_record_round_trips_and_refuses_what_it_cannot_read():
    rec = record("chatcmpl-r")
    assert CarryRecord.decode(rec.encode()) == rec
    assert CarryRecord.decode(b'{"v": 99}') is None and CarryRecord.decode(b"not json") is None
    assert CarryRecord.decode(rec.encode().replace(b'"api":"chat"', b'"api":"embeddings"')) is None
    # the body's bytes as sent, newlines and all, and of any size the gateway takes (over 256 KiB too)
    big = dataclasses.replace(rec, body=b'{"model": "default",\n "messages": []}' + b"\n " * 200_000)
    assert CarryRecord.decode(big.encode()) == big
    first_version = json.dumps({"v": 1, "api": "chat", "body": {}}).encode()  # the body inside the JSON
    assert CarryRecord.decode(first_version) is None
    res = rec.lease.reservation(tenant=None)  # type: ignore[arg-type]
    assert (res.lease_id, res.prompt_tokens, res.max_tokens, res.renewed_at) == ("lease-1", 10, 20, 0.0)


async def test_one_gateway_claims_a_lost_stream_and_an_ended_one_is_not_claimed(client):
    logs = EventLogs(client)
    await client.set(carry_key("acme", "chatcmpl-c"), record("chatcmpl-c").encode())
    entry = {b"s": 0, b"d": b"data: {}\n\n", b"t": b"", b"n": bytes(4)}
    await client.xadd(log_key("acme", "chatcmpl-c"), entry, id="0-1")
    started: list[str] = []

    class Recording(CarryOn):
        async def _run(self, rec, logged):  # noqa: ANN001
            started.append(rec.stream_id)

    first, second = (Recording(logs, None, None, {}, None) for _ in range(2))  # type: ignore[arg-type]
    assert await first.claim("acme", "chatcmpl-c") and await second.claim("acme", "chatcmpl-c")
    await asyncio.sleep(0)
    assert started == ["chatcmpl-c"] and await client.get(owner_key("acme", "chatcmpl-c")) == logs.owner_id
    assert not await first.claim("other", "chatcmpl-c")  # another tenant's stream: not found under its tag
    await client.xadd(log_key("acme", "chatcmpl-e"), {b"end": b"done"}, id="0-1")
    await client.set(carry_key("acme", "chatcmpl-e"), record("chatcmpl-e").encode())
    assert not await first.claim("acme", "chatcmpl-e")
    assert not await client.exists(owner_key("acme", "chatcmpl-e"))


async def test_logged_groups_replay_then_the_live_rest_or_a_logged_finish():
    async def live():
        yield_from = [[9], [10]]
        for tokens in yield_from:
            from worker.protocol import OutItem
            yield OutItem("r", tokens, None, 0, None)

    got = [c.tokens async for c in replayed_then_live("r", [([1, 2], None), ([3], None)], 4, 100, live)]
    assert got == [[1, 2], [3], [9], [10]]
    finished = [(c.tokens, c.finish_reason)
                async for c in replayed_then_live("r", [([1], None), ([], "stop")], 4, 100, live)]
    assert finished == [([1], None), ([], "stop")]
    full = [(c.tokens, c.finish_reason) async for c in replayed_then_live("r", [([1, 2], None)], 4, 2, live)]
    assert full == [([1, 2], None), ([], "length")]  # max_tokens reached: no worker asked


async def test_a_stalled_gateway_stops_its_copy_once_another_took_the_stream(client):
    logs, gen = EventLogs(client, flush_s=0.01), FakeGeneration()
    gate = asyncio.Event()

    async def slow():
        for i in range(1000):
            gen.token_ids.append(i)
            if i == 3:
                await gate.wait()
            await asyncio.sleep(0.005)
            yield b"data: {}\n\n"

    stream = ResumableStream(logs, "acme", "chatcmpl-s", slow(), nothing, source=gen,
                             carry=record("chatcmpl-s").encode())
    reader = asyncio.create_task(asyncio.wait_for(_drain(stream), 10))
    await asyncio.sleep(0.1)
    await client.set(owner_key("acme", "chatcmpl-s"), b"another-gateway")
    gate.set()
    events = await reader
    assert events < 1000  # it stopped instead of generating on
    await logs.close()
    assert not [e for e in await client.xrange(log_key("acme", "chatcmpl-s")) if b"end" in e[1]]


async def _drain(stream: ResumableStream) -> int:
    n = 0
    async for chunk in stream.body():
        n += chunk.count(b"\n\n")
    await stream.close()
    return n
