"""Issue 9, case 2: Redis restarted under load, the gateway never restarted.

Four clients keep streaming requests going through the shared cluster's gateway. Redis is stopped
(its data saved, as a restart keeps it) for three seconds: every request that arrives meanwhile gets a
503 `quota_service_unavailable` with `retry-after` quickly (p99 < 2 s over all of them), and streams
that were already running finish. Redis then comes back empty of Lua scripts (they are not persisted):
the first request after it is admitted again with no gateway restart, which only works because the
admission scripts answer NOSCRIPT by loading themselves; `SCRIPT EXISTS` shows them gone before and
back after. Leases whose settle could not reach Redis expire within one lease TTL, and the gateway
logged no ERROR without a request id.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from admission.lua.scripts import RESERVE, SETTLE
from tenancy.redis_client import sync_client
from tenancy.schema import leases_key
from tests.admission_stack import redis_now_us
from tests.faults.client import StreamResult, completion_body, p99, stream_completion
from tests.faults.cluster import SHARED_GATEWAY_SETTINGS, FaultCluster, unattributed_errors

pytestmark = pytest.mark.timeout(480)  # includes the shared cluster start-up
TENANT = "rr-tenant"
OUTAGE_S, CLIENTS, MAX_TOKENS = 3.0, 4, 16
LEASE_TTL_S = float(SHARED_GATEWAY_SETTINGS["lease_ttl"])  # type: ignore[arg-type]



def scripts_loaded(url: str) -> list[bool]:
    r = sync_client(url)
    try:
        return list(r.script_exists(RESERVE.sha, SETTLE.sha))
    finally:
        r.close()


async def test_redis_restart_during_load(cluster: FaultCluster) -> None:
    key = cluster.create_tenant(TENANT, tpm=0, rpm=0, max_concurrent=100)
    gw = cluster.gateways[0]
    pid = gw.proc.pid
    stop = asyncio.Event()
    results: list[tuple[float, StreamResult]] = []  # (monotonic start, result)

    async def client(http: httpx.AsyncClient, c: int) -> None:
        i = 0
        while not stop.is_set():
            body = completion_body([2000 + (31 * c + 7 * i + j) % 40_000 for j in range(20)], MAX_TOKENS)
            began = time.monotonic()
            res = await stream_completion(http, gw.base_url, key, body)
            results.append((began, res))
            i += 1
            if res.outcome == "refused":
                await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=20)) as http:
        clients = [asyncio.create_task(client(http, c)) for c in range(CLIENTS)]
        try:
            await asyncio.sleep(3.0)  # steady load
            assert scripts_loaded(cluster.redis.url) == [True, True]
            stopping_at = time.monotonic()
            await asyncio.to_thread(cluster.redis.stop)
            down_at = time.monotonic()
            await asyncio.sleep(OUTAGE_S)
            stop.set()
            async with asyncio.timeout(60):
                await asyncio.gather(*clients)
        finally:
            stop.set()
            for task in clients:
                task.cancel()
        await asyncio.to_thread(cluster.redis.start)
        up_at = time.monotonic()
        assert scripts_loaded(cluster.redis.url) == [False, False], \
            "the restarted Redis should have no scripts"
        deadline = time.monotonic() + 10
        while True:
            after = await stream_completion(http, gw.base_url, key,
                                            completion_body(list(range(3000, 3020)), 4))
            if after.outcome == "completed":
                break
            assert time.monotonic() < deadline, f"not served again after Redis came back: {after}"
            await asyncio.sleep(0.2)
        recovered_s = time.monotonic() - up_at
        # The gateway settles after the last byte has gone out, so the settle script may load a moment later.
        settle_deadline = time.monotonic() + 5
        while scripts_loaded(cluster.redis.url) != [True, True] and time.monotonic() < settle_deadline:
            await asyncio.sleep(0.05)
    assert scripts_loaded(cluster.redis.url) == [True, True], \
        "NOSCRIPT was not answered by loading the script"

    # Before the outage: every request that had ended, or was already streaming, when Redis began to stop
    # (SAVE, SIGTERM, exit: `down_at` is when that is over). One that began just before the stop and was
    # still being admitted races it, as one just after does.
    before = [res for began, res in results if began + res.elapsed_s < stopping_at
              or (res.ttft_s is not None and began + res.ttft_s < stopping_at)]
    during = [res for began, res in results if began >= down_at + 0.2]  # a request just before the stop races
    classified = {id(res) for res in before + during}
    racing = [res for _, res in results if id(res) not in classified]
    print(f"before the outage {dict(Counter(r.outcome for r in before))}, during "
          f"{dict(Counter(r.outcome for r in during))}, "
          f"racing the stop {dict(Counter(r.outcome for r in racing))}; "
          f"p99 refusal latency {p99([r.elapsed_s for r in during]) * 1000:.0f} ms; served again "
          f"{recovered_s:.2f}s after Redis was started")
    assert before and all(r.outcome == "completed" for r in before), \
        [r for r in before if r.outcome != "completed"]
    assert len(during) >= CLIENTS
    for res in during:
        assert res.status == 503 and res.code == "quota_service_unavailable", res
        assert res.headers.get("retry-after") == "1"
    assert p99([r.elapsed_s for r in during]) < 2.0
    assert gw.proc.poll() is None and gw.proc.pid == pid

    # leases whose settle failed during the outage expire by their TTL: none is live afterwards
    r = sync_client(cluster.redis.url)
    try:
        deadline = time.monotonic() + LEASE_TTL_S + 2
        while r.zcount(leases_key(TENANT), redis_now_us(r), "+inf") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert r.zcount(leases_key(TENANT), redis_now_us(r), "+inf") == 0
    finally:
        r.close()
    assert unattributed_errors(gw) == []
