"""WorkerClient against a real ZeroMQ ROUTER peer driven by the
test (the worker process tests cover the rest).

The peer is a real socket speaking the real codec, so these tests pin the client's
own behaviour: demultiplexing, errors, deadlines, abort on early exit, version refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from router.links.client import WorkerClient, WorkerError
from tests.conftest import free_port
from worker import protocol as p

pytestmark = pytest.mark.timeout(30)


class Peer:
    """The worker's side of the link: a ROUTER socket the test scripts by hand."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.endpoint)

    async def recv(self, kind: str, timeout: float = 5.0) -> tuple[bytes, object]:
        """Next frame of type `kind` (others skipped): (gateway identity, decoded frame)."""
        async with asyncio.timeout(timeout):
            while True:
                ident, data = await self.sock.recv_multipart()
                frame = p.decode_gateway_frame(data, max_prompt_tokens=1 << 16)
                if {p.Hello: "hello", p.GenRequest: "gen", p.Abort: "abort"}[type(frame)] == kind:
                    return ident, frame

    async def send(self, ident: bytes, payload: bytes) -> None:
        await self.sock.send_multipart([ident, payload])

    async def stats(self, ident: bytes, version: int = p.PROTOCOL_VERSION, draining: bool = False) -> None:
        await self.send(ident, p.encode_stats(p.WorkerStats("w", 0, 0, 10, 20, 0.0, draining, "m", version)))


@pytest.fixture()
async def link() -> AsyncIterator[tuple[Peer, WorkerClient]]:
    ctx = zmq.asyncio.Context()
    peer = Peer(ctx)
    seen: list[p.WorkerStats] = []
    client = WorkerClient(peer.endpoint, gateway_id="gw-test", context=ctx, inter_token_timeout=1.0,
                          worker_timeout=0.5, heartbeat_interval=0.2, on_stats=lambda c, s: seen.append(s))
    client.seen = seen  # type: ignore[attr-defined]
    await client.start()
    try:
        ident, hello = await peer.recv("hello")
        assert hello == p.Hello("gw-test")
        assert ident.startswith(b"gw-test/") and len(ident) >= len(b"gw-test/") + 32  # unguessable routing id
        await peer.stats(ident)
        stats = await client.wait_ready(5.0)
        assert stats.kv_total == 20 and client.alive and client.usable
        yield peer, client
    finally:
        await client.close()
        peer.sock.close()
        ctx.term()


async def test_streams_tokens_and_callback(link: tuple[Peer, WorkerClient]) -> None:
    peer, client = link
    assert client.seen  # type: ignore[attr-defined]
    stream = client.generate("r1", b"ns", [1, 2, 3], p.SamplingParams(max_tokens=3),
                             priority=p.Priority.BATCH, deadline=99.0)
    got: list[p.OutItem] = []

    async def consume() -> None:
        async for chunk in stream:
            got.append(chunk)

    task = asyncio.create_task(consume())
    ident, gen = await peer.recv("gen")
    assert (gen.rid == "r1" and gen.tokens.tolist() == [1, 2, 3] and gen.priority == p.Priority.BATCH
            and gen.deadline == 99.0)
    other = p.OutItem("zz", [9], None, 0, None)  # an unknown rid is ignored
    await peer.send(ident, p.encode_out([p.OutItem("r1", [7], None, 2, [-0.5]), other], sent_at=5.0))
    await peer.send(ident, p.encode_out([p.OutItem("r1", [8, 9], "length", 2, None)]))
    await asyncio.wait_for(task, 5)
    assert got == [p.OutItem("r1", [7], None, 2, [-0.5], sent_at=5.0),
                   p.OutItem("r1", [8, 9], "length", 2, None)]
    assert client.open_streams == 0


async def test_err_frame_raises_worker_error(link: tuple[Peer, WorkerClient]) -> None:
    peer, client = link

    async def consume() -> None:
        async for _ in client.generate("r2", b"", [1], p.SamplingParams()):
            pass

    task = asyncio.create_task(consume())
    ident, _ = await peer.recv("gen")
    await peer.send(ident, p.encode_err("r2", "capacity", "worker is draining", True))
    with pytest.raises(WorkerError) as info:
        await asyncio.wait_for(task, 5)
    assert info.value.code is p.ErrorCode.CAPACITY and info.value.retryable
    assert "draining" in info.value.message


async def test_leaving_early_sends_abort(link: tuple[Peer, WorkerClient]) -> None:
    peer, client = link

    async def consume_one() -> list[int]:
        async for chunk in client.generate("r3", b"", [1], p.SamplingParams()):
            return chunk.tokens
        return []

    task = asyncio.create_task(consume_one())
    ident, _ = await peer.recv("gen")
    await peer.send(ident, p.encode_out([p.OutItem("r3", [4], None, 0, None)]))
    assert await asyncio.wait_for(task, 5) == [4]
    _, abort = await peer.recv("abort")
    assert abort == p.Abort("r3")


async def test_cancellation_sends_abort(link: tuple[Peer, WorkerClient]) -> None:
    peer, client = link

    async def consume() -> None:
        async for _ in client.generate("r4", b"", [1], p.SamplingParams()):
            pass

    task = asyncio.create_task(consume())
    await peer.recv("gen")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _, abort = await peer.recv("abort")
    assert abort == p.Abort("r4")


async def test_inter_token_timeout(link: tuple[Peer, WorkerClient]) -> None:
    peer, client = link
    loop = asyncio.get_running_loop()

    async def keep_alive(ident: bytes) -> None:
        while True:  # stats keep flowing, tokens do not
            await peer.stats(ident)
            await asyncio.sleep(0.1)

    start = loop.time()
    stream = client.generate("r5", b"", [1], p.SamplingParams())
    consumer = asyncio.create_task(stream.__anext__())
    ident, _ = await peer.recv("gen")
    beat = asyncio.create_task(keep_alive(ident))
    try:
        with pytest.raises(WorkerError) as info:
            await asyncio.wait_for(consumer, 5)
    finally:
        beat.cancel()
    assert info.value.code == "timeout" and info.value.retryable
    assert 0.9 <= loop.time() - start < 3.0
    _, abort = await peer.recv("abort")
    assert abort.rid == "r5"


async def test_queued_request_waits_for_its_first_token_until_its_deadline(
        link: tuple[Peer, WorkerClient]) -> None:
    """A request queued behind others gets its first token after more than inter_token_timeout (1 s here): the
    wait before it is bounded by the request's deadline instead; gaps
    after it by inter_token_timeout again."""
    peer, client = link
    loop = asyncio.get_running_loop()
    stream = client.generate("r7", b"", [1], p.SamplingParams(max_tokens=4), deadline=time.time() + 4.0)
    first = asyncio.create_task(stream.__anext__())
    ident, _ = await peer.recv("gen")

    async def keep_alive() -> None:
        while True:
            await peer.stats(ident)
            await asyncio.sleep(0.1)

    beat = asyncio.create_task(keep_alive())
    try:
        await asyncio.sleep(1.6)
        assert not first.done()
        await peer.send(ident, p.encode_out([p.OutItem("r7", [5], None, 0, None)]))
        assert (await asyncio.wait_for(first, 2)).tokens == [5]
        start = loop.time()
        with pytest.raises(WorkerError) as info:
            await asyncio.wait_for(stream.__anext__(), 5)
        assert info.value.code == "timeout" and 0.9 <= loop.time() - start < 1.8
    finally:
        beat.cancel()


async def test_worker_loss_ends_streams(link: tuple[Peer, WorkerClient]) -> None:
    """A dead worker (its socket closed: the link goes down) is lost as soon as the connection drops, well
    before worker_timeout of silence, also for a request sent to it afterwards."""
    peer, client = link
    client.inter_token_timeout = 10.0
    client.worker_timeout = 3.0  # silence alone would take 3 s
    loop = asyncio.get_running_loop()

    async def consume() -> None:
        async for _ in client.generate("r6", b"", [1], p.SamplingParams()):
            pass

    task = asyncio.create_task(consume())
    await peer.recv("gen")
    assert client.link_up
    peer.sock.close(linger=0)
    start = loop.time()
    with pytest.raises(WorkerError) as info:
        await asyncio.wait_for(task, 5)
    assert info.value.code == "worker_lost" and info.value.retryable and "link down" in info.value.message
    assert loop.time() - start < 0.5
    assert not client.alive and not client.link_up
    # a request sent after the loss was reported (routed just before the drop) ends too, not at its deadline
    start = loop.time()
    with pytest.raises(WorkerError) as info:
        await asyncio.wait_for(_collect(client.generate("r8", b"", [1], p.SamplingParams(),
                                                        deadline=time.time() + 60)), 5)
    assert info.value.code == "worker_lost" and loop.time() - start < 0.5


async def test_silent_worker_with_a_live_link_is_lost_only_after_the_stall_timeout(
        link: tuple[Peer, WorkerClient]) -> None:
    """Stats stop but the link answers pings (a busy worker loop): streams survive worker_timeout and end
    with worker_lost once stall_timeout passes."""
    peer, client = link
    client.inter_token_timeout = 10.0
    client.stall_timeout = 2.0
    loop = asyncio.get_running_loop()

    async def consume() -> None:
        async for _ in client.generate("r6", b"", [1], p.SamplingParams()):
            pass

    task = asyncio.create_task(consume())
    await peer.recv("gen")
    start = loop.time()
    await asyncio.sleep(1.2)  # more than twice worker_timeout (0.5 s)
    assert client.link_up and client.alive and not task.done()
    with pytest.raises(WorkerError) as info:
        await asyncio.wait_for(task, 5)
    assert info.value.code == "worker_lost" and "link up" in info.value.message
    assert 1.9 <= loop.time() - start < 4.0


async def test_incompatible_version_is_refused(link: tuple[Peer, WorkerClient]) -> None:
    peer, client = link
    ident, _ = await peer.recv("hello")
    await peer.stats(ident, version=p.PROTOCOL_VERSION + 1)
    async with asyncio.timeout(5):
        while client.incompatible is None:
            await asyncio.sleep(0.01)
    assert not client.usable
    with pytest.raises(WorkerError) as info:
        async for _ in client.generate("r7", b"", [1], p.SamplingParams()):
            pass
    assert info.value.code == "incompatible" and not info.value.retryable


async def test_close_ends_open_streams(link: tuple[Peer, WorkerClient]) -> None:
    peer, client = link
    client.inter_token_timeout = 10.0

    async def consume() -> None:
        async for _ in client.generate("r8", b"", [1], p.SamplingParams()):
            pass

    task = asyncio.create_task(consume())
    await peer.recv("gen")
    await client.close()
    with pytest.raises(WorkerError) as info:
        await asyncio.wait_for(task, 5)
    assert info.value.code == "closed"


async def test_duplicate_rid_rejected(link: tuple[Peer, WorkerClient]) -> None:
    peer, client = link
    first = client.generate("dup", b"", [1], p.SamplingParams())
    task = asyncio.create_task(first.__anext__())
    await peer.recv("gen")
    with pytest.raises(ValueError):
        async for _ in client.generate("dup", b"", [1], p.SamplingParams()):
            pass
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await first.aclose()


async def test_wait_ready_times_out_without_worker() -> None:
    ctx = zmq.asyncio.Context()
    client = WorkerClient(f"tcp://127.0.0.1:{free_port()}", gateway_id="gw-x", context=ctx)
    await client.start()
    try:
        with pytest.raises(WorkerError) as info:
            await client.wait_ready(0.3)
        assert info.value.code == "timeout"
    finally:
        await client.close()
        ctx.term()


async def test_malformed_out_frames_end_only_their_requests(link: tuple[Peer, WorkerClient]) -> None:
    """A bad `out` frame ends the requests it names with a retryable error; the link stays usable."""
    peer, client = link
    client.inter_token_timeout = 10.0
    streams = {rid: client.generate(rid, b"", [1], p.SamplingParams()) for rid in ("m1", "m2", "m3")}
    firsts = {rid: asyncio.create_task(s.__anext__()) for rid, s in streams.items()}
    for _ in streams:
        ident, _gen = await peer.recv("gen")
    good = [p.OutItem("m1", [5], None, 0, None)]
    await peer.send(ident, p.encode_out(good))
    assert (await asyncio.wait_for(firsts["m1"], 5)).tokens == [5]
    bad = msgpack.unpackb(p.encode_out([p.OutItem("m1", [6], None, 0, None),
                                        p.OutItem("m2", [6], None, 0, None)]),
                          raw=False)
    bad["items"][1][3] = "lots"  # cached_tokens of the wrong type: both rows of the frame are lost
    await peer.send(ident, msgpack.packb(bad, use_bin_type=True))
    unnamed = msgpack.unpackb(p.encode_out([p.OutItem("m3", [6], None, 0, None)]), raw=False)
    unnamed["items"][0][0] = [1, 2]  # an unhashable rid: nothing to end, only a log line
    await peer.send(ident, msgpack.packb(unnamed, use_bin_type=True))
    for rid in ("m1", "m2"):
        with pytest.raises(WorkerError) as info:
            await asyncio.wait_for(streams[rid].__anext__() if rid == "m1" else firsts[rid], 5)
        assert info.value.code == "protocol" and info.value.retryable
    await peer.send(ident, p.encode_out([p.OutItem("m3", [8], "stop", 0, None)]))
    assert (await asyncio.wait_for(firsts["m3"], 5)).finish_reason == "stop"
    for _ in range(3):  # the receive task is still running: stats keep it alive, new requests work
        await peer.stats(ident)
        await asyncio.sleep(0.2)
    assert client.usable
    task = asyncio.create_task(_collect(client.generate("m4", b"", [1], p.SamplingParams())))
    await peer.recv("gen")
    await peer.send(ident, p.encode_out([p.OutItem("m4", [3], "length", 0, None)]))
    assert await asyncio.wait_for(task, 5) == [3]
    for s in streams.values():
        await s.aclose()


async def _collect(stream: AsyncIterator[p.OutItem]) -> list[int]:
    return [t async for item in stream for t in item.tokens]


async def test_fuzzed_frames_leave_the_client_usable(link: tuple[Peer, WorkerClient]) -> None:
    """Every wrong-typed frame of the protocol fuzz cases, sent to a live client (stats frames only when
    they do not decode: a valid one naming another protocol version rightly makes the worker incompatible)."""
    from tests.worker.protocol.test_protocol_fuzz import CASES

    peer, client = link
    ident, _ = await peer.recv("hello")
    broken = []
    for _label, frame in CASES:
        data = msgpack.packb(frame, use_bin_type=True)
        if frame.get("t") == "stats":
            with contextlib.suppress(p.ProtocolError):
                p.decode_worker_frame(data)
                continue
        broken.append(data)
    assert len(broken) > 300
    for i, data in enumerate(broken):
        await peer.send(ident, data)
        if i % 50 == 0:
            await peer.stats(ident)
    await peer.stats(ident)
    await asyncio.sleep(0.3)
    assert client.usable and not any(t.done() for t in client._tasks)
    task = asyncio.create_task(_collect(client.generate("fz", b"", [1], p.SamplingParams())))
    await peer.recv("gen")
    await peer.send(ident, p.encode_out([p.OutItem("fz", [2, 3], "length", 0, None)]))
    assert await asyncio.wait_for(task, 5) == [2, 3]


async def test_an_oversized_worker_frame_drops_the_link_not_the_gateway(
        link: tuple[Peer, WorkerClient]) -> None:
    """The gateway's worker socket refuses frames past MAX_WORKER_FRAME_BYTES (it once took any size): the
    link drops and comes back, and the client keeps working."""
    from router.links.client import MAX_WORKER_FRAME_BYTES

    peer, client = link
    stream = client.generate("big", b"ns", [1, 2], p.SamplingParams(max_tokens=2))
    first = asyncio.ensure_future(anext(stream))
    ident, _ = await peer.recv("gen")
    await peer.send(ident, b"\x00" * (MAX_WORKER_FRAME_BYTES + 1))
    with pytest.raises(WorkerError):  # the stream on the dropped link ends with a link error
        await asyncio.wait_for(first, 10)
    await stream.aclose()
    assert client._sock.getsockopt(zmq.MAXMSGSIZE) == MAX_WORKER_FRAME_BYTES
