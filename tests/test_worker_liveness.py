"""The gateway's liveness rule against a real worker process: a frozen worker (SIGSTOP: its ZeroMQ I/O thread
stops answering pings too) is lost within about `worker_timeout`, like a dead one; the link's state is what
tells it apart from a busy worker, whose I/O thread keeps answering (tests/test_router_client.py)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from router.client import WorkerClient, WorkerError
from tests.worker_procs import WorkerProc
from worker.protocol import SamplingParams

pytestmark = pytest.mark.timeout(120)


async def test_a_frozen_worker_is_lost_within_the_worker_timeout(tmp_path: Path) -> None:
    """(A killed one closes the link at once: tests/test_router_client.py and the fault tests.)"""
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
