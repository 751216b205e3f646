"""Issue 9, case 3: a rolling restart, gateway then worker, with streams open.

Gateway: 20 streams run through the shared cluster's gateway when it gets SIGTERM; a replacement
gateway is started at the same moment, as a deploy would. While the old one drains, new requests to
it get 503 `server_shutting_down` with `retry-after`; all 20 streams still run to `[DONE]` with every
token, the old process exits 0, and the replacement serves. Worker: 15 streams run over the three
workers when one of them gets SIGTERM; it keeps streaming what it has (all 15 complete) while the
gateway sends it nothing new (its `switchyard_router_requests_total` series stays put while 8 new
requests are served by the others), and it exits 0 once its streams are done.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from config.local_stack.launcher import WorkerProc
from tests.faults.client import StreamResult, completion_body, metric, stream_completion
from tests.faults.cluster import FaultCluster, unattributed_errors

pytestmark = pytest.mark.timeout(480)  # includes the shared cluster start-up
# Streams long enough to outlive the drain checks on a quiet box (tiny-random decodes a step in ~ms;
# a quiet 2-core box measured ~10 s for the 20 gateway streams at 512 tokens and ~4 s for the 15 worker
# streams, against under 0.5 s and about 1 s of checks), and small enough to fit the shared workers'
# KV (8,192 tokens each) with room to spare.
GATEWAY_MAX_TOKENS, WORKER_MAX_TOKENS = 256, 512


def prompt(i: int) -> list[int]:
    return [4000 + (53 * i + j) % 40_000 for j in range(20)]


async def open_streams(http: httpx.AsyncClient, url: str, key: str, n: int, max_tokens: int,
                       first: int = 0) -> list[asyncio.Task[StreamResult]]:
    """Start `n` long streams and return once every one has produced a token."""
    started = asyncio.Semaphore(0)
    tasks = [asyncio.create_task(stream_completion(http, url, key,
                                                   completion_body(prompt(first + i), max_tokens),
                                                   started)) for i in range(n)]
    async with asyncio.timeout(60):
        for _ in range(n):
            await started.acquire()
    return tasks


async def wait_gateway_draining(http: httpx.AsyncClient, base_url: str, timeout: float = 10.0) -> None:
    """Return once the gateway answers `/ready` with 503 draining: it acts on SIGTERM at its next tick
    (100 ms), and a request sent before that is still served."""
    deadline = time.monotonic() + timeout
    while True:
        resp = await http.get(base_url + "/ready")
        if resp.status_code == 503 and resp.json().get("status") == "draining":
            return
        assert time.monotonic() < deadline, \
            f"the gateway did not start draining: {resp.status_code} {resp.text}"
        await asyncio.sleep(0.02)


async def sigterm_worker(victim: WorkerProc, timeout: float = 10.0) -> None:
    """SIGTERM `victim` and return once its stats say `draining`, as an observer client connected
    beforehand hears them (the worker sends stats to every client about every 100 ms)."""
    from router.links.client import WorkerClient

    observer = WorkerClient(victim.endpoint, gateway_id=f"roll-observer-{time.monotonic_ns()}",
                            worker_timeout=5.0)
    await observer.start()
    try:
        await observer.wait_ready(timeout)
        victim.signal(signal.SIGTERM)
        async with asyncio.timeout(timeout):
            while observer.stats is None or not observer.stats.draining:
                await asyncio.sleep(0.02)
    finally:
        await observer.close()


def assert_all_completed(results: list[StreamResult], max_tokens: int) -> None:
    bad = [r for r in results if r.outcome != "completed" or r.tokens != max_tokens]
    assert not bad, bad


async def test_gateway_sigterm_finishes_20_streams(cluster: FaultCluster) -> None:
    key = cluster.create_tenant("roll-gw", tpm=0, rpm=0, max_concurrent=0)
    old = cluster.gateways[0]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=50)) as http:
        streams = await open_streams(http, old.base_url, key, 20, GATEWAY_MAX_TOKENS)
        old.proc.send_signal(signal.SIGTERM)
        cluster.gateways[0] = replacement = cluster.spawn_gateway()
        await wait_gateway_draining(http, old.base_url)
        refused = []
        for i in range(5):
            res = await stream_completion(http, old.base_url, key, completion_body(prompt(100 + i), 4))
            refused.append(res)
        open_at_end = sum(not s.done() for s in streams)
        results = await asyncio.gather(*streams)
    assert open_at_end > 0, "the streams ended before the drain could be observed"
    for res in refused:
        assert res.status == 503 and res.code == "server_shutting_down", res
        assert res.headers.get("retry-after") == "1"
    assert_all_completed(results, GATEWAY_MAX_TOKENS)
    assert await asyncio.to_thread(old.proc.wait, 20) == 0
    assert unattributed_errors(old) == []
    await asyncio.to_thread(cluster.wait_ready, 120, [replacement])
    async with httpx.AsyncClient(timeout=60) as http:
        after = await stream_completion(http, replacement.base_url, key, completion_body(prompt(200), 4))
    assert after.outcome == "completed", after
    print(f"gateway drain: 20/20 streams completed, {len(refused)} new requests refused with 503 + "
          f"retry-after, exit 0; streams took {min(r.elapsed_s for r in results):.1f}-"
          f"{max(r.elapsed_s for r in results):.1f}s")


async def test_worker_sigterm_finishes_its_streams_and_gets_no_new_ones(cluster: FaultCluster) -> None:
    key = cluster.create_tenant("roll-wk", tpm=0, rpm=0, max_concurrent=0)
    gw, victim = cluster.gateways[0], cluster.workers[0]
    series = f'worker="{victim.endpoint}"'
    sent_before = metric(gw.base_url, "switchyard_router_requests_total", series)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=50)) as http:
        streams = await open_streams(http, gw.base_url, key, 15, WORKER_MAX_TOKENS, first=300)
        on_victim = metric(gw.base_url, "switchyard_router_requests_total", series) - sent_before
        assert on_victim >= 1, "no stream landed on the worker to be stopped"
        await sigterm_worker(victim)
        await asyncio.sleep(0.3)  # the gateway's copy of those stats, sent at the same time, is handled
        sent_draining = metric(gw.base_url, "switchyard_router_requests_total", series)
        new = await asyncio.gather(*(stream_completion(http, gw.base_url, key,
                                                       completion_body(prompt(400 + i), 4))
                                     for i in range(8)))
        assert metric(gw.base_url, "switchyard_router_requests_total", series) == sent_draining
        assert all(r.outcome == "completed" for r in new), new
        assert not all(s.done() for s in streams), "the streams ended before the drain could be observed"
        results = await asyncio.gather(*streams)
    assert_all_completed(results, WORKER_MAX_TOKENS)
    assert await asyncio.to_thread(victim.wait, 30) == 0
    assert unattributed_errors(gw) == []
    print(f"worker drain: {on_victim:.0f} of 15 streams were on the stopped worker, all 15 completed; "
          "8 new requests served by the others; streams took "
          f"{min(r.elapsed_s for r in results):.1f}-{max(r.elapsed_s for r in results):.1f}s")
