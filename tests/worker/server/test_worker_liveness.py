"""The gateway's liveness rule: a frozen worker process (SIGSTOP: its ZeroMQ I/O thread stops answering pings
too) is lost within about `worker_timeout`, like a dead one; the link's state is what tells it apart from a
busy worker, whose I/O thread keeps answering (tests/router/test_router_client.py); and a stall of the
gateway's own event loop is not taken for a worker's silence (`ThreadWorker`, also used by
tests/router/test_router_membership.py)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

from config.local_stack.launcher import WorkerProc
from router.links.client import WorkerClient, WorkerError
from tests.conftest import free_port
from worker import protocol as p
from worker.protocol import SamplingParams

pytestmark = pytest.mark.timeout(120)


async def test_a_frozen_worker_is_lost_within_the_worker_timeout(tmp_path: Path) -> None:
    """(A killed one closes the link at once: tests/router/test_router_client.py and the fault tests.)"""
    worker = WorkerProc(tmp_path)
    client = WorkerClient(worker.endpoint, gateway_id=f"live-{time.monotonic_ns()}", worker_timeout=1.0,
                          stall_timeout=30.0, inter_token_timeout=60.0)
    try:
        await client.start()
        try:
            await client.wait_ready(90)
        except WorkerError:
            pytest.fail("worker not ready:\n" + worker.log_text())
        stream = client.generate("long", b"ns", [5, 6, 7], SamplingParams(max_tokens=5000, ignore_eos=True,
                                                                          speculative=False))
        await stream.__anext__()
        assert client.link_up
        worker.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(WorkerError) as err:
            async with asyncio.timeout(20):
                async for _ in stream:
                    pass
        waited = time.monotonic() - stopped_at
        assert err.value.code == "worker_lost" and "link down" in err.value.message
        assert waited < 1.0 + 1.5, f"lost after {waited:.2f} s"  # worker_timeout, a ping interval, slack
        assert not client.link_up
    finally:
        await client.close()
        worker.signal(signal.SIGKILL)  # also ends a stopped process
        worker.stop()


class ThreadWorker:
    """A worker's ROUTER socket served from its own thread: it keeps sending stats every 50 ms, and ends a
    request 1.5 s after its `gen`, while the test's event loop may be blocked."""

    def __init__(self, endpoint: str | None = None) -> None:
        self.endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
        self.stop = threading.Event()
        self.bound = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.bound.wait(5)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self.bound.set()
        idents: set[bytes] = set()
        due: list[tuple[float, bytes, str]] = []
        stats = p.encode_stats(p.WorkerStats("w", 0, 0, 10, 20, 0.0, False, "m", p.PROTOCOL_VERSION))
        while not self.stop.is_set():
            while sock.poll(0):
                ident, data = sock.recv_multipart()
                idents.add(ident)
                frame = p.decode_gateway_frame(data, 1 << 16)
                if isinstance(frame, p.GenRequest):
                    due.append((time.monotonic() + 1.5, ident, frame.rid))
            for ident in idents:
                sock.send_multipart([ident, stats])
            for entry in [d for d in due if d[0] <= time.monotonic()]:
                due.remove(entry)
                sock.send_multipart([entry[1], p.encode_out([p.OutItem(entry[2], [4], "stop", 0, None)])])
            time.sleep(0.05)
        sock.close()
        ctx.term()


async def test_event_loop_stall_is_not_worker_loss() -> None:
    """Stats queue up in the socket while the gateway's loop is blocked: the link is judged on what it has
    received once it drains, not on the wall clock, so a stall is no worker loss; real silence still is."""
    worker = ThreadWorker()
    client = WorkerClient(worker.endpoint, gateway_id="gw-stall", worker_timeout=0.5, heartbeat_interval=0.2,
                          inter_token_timeout=10.0)
    await client.start()
    try:
        await client.wait_ready(5)
        stream = client.generate("st", b"", [1], p.SamplingParams())
        first = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.2)
        time.sleep(1.2)  # the gateway's event loop stalls for more than twice the worker timeout
        assert client.alive, "a stall of the gateway's own loop counted as the worker's silence"
        assert (await asyncio.wait_for(first, 5)).finish_reason == "stop"  # no worker_lost meanwhile
        await stream.aclose()
        worker.stop.set()
        loop = asyncio.get_running_loop()
        stopped_at = loop.time()
        while client.alive:
            await asyncio.sleep(0.05)
            assert loop.time() - stopped_at < 3, "real silence was not noticed"
    finally:
        worker.stop.set()
        await client.close()
        worker.thread.join(5)
