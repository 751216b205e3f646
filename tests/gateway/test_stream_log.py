"""Resumable streams against a real Redis: event ids, the batched log (bounded, expiring), replay then live
tail, a client that leaves (the stream runs on, detached, within its grace), a lost gateway, tenant scope."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.streams.event_log import EventLogs, live_key, log_key
from gateway.streams.replay import Replay, split
from gateway.streams.resumable import ResumableStream
from gateway.web.api_errors import ApiError
from tenancy.redis_client import async_client


@pytest.fixture()
async def client(redis_url):
    redis = async_client(redis_url)
    yield redis
    await redis.aclose()


def ev(i: int) -> bytes:
    return b'data: {"n":%d}\n\n' % i


async def source(n: int, gate: asyncio.Event | None = None, at: int = -1, delay: float = 0.0):
    for i in range(n):
        if i == at and gate is not None:
            await gate.wait()
        if delay:
            await asyncio.sleep(delay)
        yield ev(i)


class Closer:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1


async def read(replay: Replay) -> list[bytes]:
    await replay.check()
    return [e async for e in replay.events()]


async def test_events_carry_ids_and_replay_after_any_one(client):
    logs, closer = EventLogs(client, flush_s=0.01), Closer()
    stream = ResumableStream(logs, "acme", "chatcmpl-1", source(5), closer, id_prefix="chatcmpl-1:")
    got = split(b"".join([e async for e in stream.body()]))
    await stream.close()
    assert got == [b"id: chatcmpl-1:%d\n" % i + ev(i) for i in range(5)] and closer.calls == 1
    await logs.close()
    assert await read(Replay(client, "acme", "chatcmpl-1", 2, id_prefix="chatcmpl-1:")) == got[3:]
    assert await read(Replay(client, "acme", "chatcmpl-1", -1, id_prefix="chatcmpl-1:")) == got
    assert 0 < await client.ttl(log_key("acme", "chatcmpl-1")) <= 600
    assert not await client.exists(live_key("acme", "chatcmpl-1"))
    with pytest.raises(ApiError) as err:  # another tenant's stream is not found
        await Replay(client, "other", "chatcmpl-1", 0).check()
    assert err.value.status == 404


async def test_a_reader_tails_the_live_stream_and_the_writes_are_batched(client):
    logs, gate = EventLogs(client, flush_s=0.02), asyncio.Event()
    stream = ResumableStream(logs, "acme", "resp_a", source(40, gate, at=10), Closer())
    body = stream.body()
    first = []
    while len(first) < 10:
        first += split(await anext(body))
    await asyncio.sleep(0.1)  # flushed
    assert await client.xlen(log_key("acme", "resp_a")) == 1  # ten events, one entry
    reader = asyncio.create_task(read(Replay(client, "acme", "resp_a", 3, responses=True)))
    await asyncio.sleep(0.1)
    gate.set()
    rest = split(b"".join([e async for e in body]))
    await stream.close()
    assert first[0].startswith(b"id: 0\n") and len(rest) == 30
    assert await asyncio.wait_for(reader, 5) == first[4:] + rest


async def test_a_client_that_leaves_does_not_stop_the_stream(client):
    logs, closer = EventLogs(client, flush_s=0.01), Closer()
    stream = ResumableStream(logs, "acme", "cmpl-2", source(30, delay=0.005), closer, id_prefix="cmpl-2:")
    body = stream.body()
    assert (await anext(body)).startswith(b"id: cmpl-2:0\n")
    await body.aclose()  # the client is gone
    await stream.close()
    assert closer.calls == 0  # the generation runs on
    got = await asyncio.wait_for(read(Replay(client, "acme", "cmpl-2", 0, id_prefix="cmpl-2:")), 5)
    assert len(got) == 29 and got[-1].endswith(ev(29)) and closer.calls == 1


async def test_past_its_grace_a_detached_stream_is_cut(client):
    logs, closer = EventLogs(client, flush_s=0.01), Closer()
    stream = ResumableStream(logs, "acme", "cmpl-3", source(1000, delay=0.01), closer, id_prefix="cmpl-3:",
                             detach_grace_s=0.1)
    body = stream.body()
    await anext(body)
    await body.aclose()
    await stream.close()
    got = await asyncio.wait_for(read(Replay(client, "acme", "cmpl-3", 0, id_prefix="cmpl-3:")), 5)
    assert closer.calls == 1 and 2 <= len(got) < 100 and b'"code":"stream_cut"' in got[-1]


async def test_a_lost_gateway_ends_the_tail_with_an_error(client):
    logs = EventLogs(client, flush_s=0.01, live_ttl_s=0.3)
    stream = ResumableStream(logs, "acme", "resp_l", source(5, asyncio.Event(), at=3), Closer())
    body, seen = stream.body(), []
    while len(seen) < 3:
        seen += split(await anext(body))
    await asyncio.sleep(0.05)
    logs._flusher.cancel()  # the gateway dies: nothing more is written, its live key expires
    got = await asyncio.wait_for(read(Replay(client, "acme", "resp_l", -1, responses=True)), 5)
    assert len(got) == 4 and b"event: error" in got[-1] and b"stream_lost" in got[-1]
    stream._task.cancel()


async def test_the_log_is_bounded(client):
    logs = EventLogs(client, flush_s=0.01, max_entries=16)
    stream = ResumableStream(logs, "acme", "resp_b", source(40, delay=0.02), Closer())
    [e async for e in stream.body()]
    await stream.close()
    await logs.close()
    assert await client.xlen(log_key("acme", "resp_b")) == 16  # a few events per entry: one per flush
    with pytest.raises(ApiError) as err:
        await Replay(client, "acme", "resp_b", 3, responses=True).check()
    assert err.value.status == 400 and err.value.param == "starting_after"
    assert len(await read(Replay(client, "acme", "resp_b", 36, responses=True))) == 3


async def test_with_no_grace_a_client_that_leaves_ends_the_stream(client):
    logs, closer, ended = EventLogs(client, flush_s=0.01), Closer(), []

    async def inner():
        try:
            async for e in source(1000, delay=0.01):
                yield e
        finally:
            ended.append(True)  # the body's own clean-up runs (a group's closes its streams)

    stream = ResumableStream(logs, "acme", "cmpl-4", inner(), closer, id_prefix="cmpl-4:", detach_grace_s=0)
    body = stream.body()
    await anext(body)
    await body.aclose()
    await stream.close()
    # aborted and settled before the response returns
    assert closer.calls == 1 and stream._task.done() and ended
    got = await asyncio.wait_for(read(Replay(client, "acme", "cmpl-4", -1, id_prefix="cmpl-4:")), 5)
    assert len(got) < 10 and b'"code":"stream_cut"' in got[-1]


async def test_shutdown_ends_the_streams_whose_client_left(client):
    logs, closer = EventLogs(client, flush_s=0.01), Closer()
    stream = ResumableStream(logs, "acme", "cmpl-5", source(10_000, delay=0.01), closer, id_prefix="cmpl-5:")
    body = stream.body()
    await anext(body)
    await body.aclose()
    await stream.close()
    await asyncio.wait_for(logs.close(), 6)
    assert closer.calls == 1 and stream._task.done()
    got = await asyncio.wait_for(read(Replay(client, "acme", "cmpl-5", -1, id_prefix="cmpl-5:")), 5)
    assert b'"code":"stream_cut"' in got[-1]


async def test_a_reader_of_a_queued_run_waits_for_its_first_events(client):
    replay = Replay(client, "acme", "resp_q", -1, responses=True)
    replay.starts_by = time.monotonic() + 5  # as the route sets it for a queued background run
    reader = asyncio.create_task(anext(replay.events()))
    await asyncio.sleep(1.2)  # past a liveness check: a run not started yet is not lost
    assert not reader.done()
    logs = EventLogs(client, flush_s=0.01)
    stream = ResumableStream(logs, "acme", "resp_q", source(3), Closer())
    [e async for e in stream.body()]
    assert (await asyncio.wait_for(reader, 5)).startswith(b"id: 0\n")
    await stream.close()
    await logs.close()
