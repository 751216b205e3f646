"""Issue 9, case 1: a worker SIGKILLed while 64 streams run across 3 workers, through a real gateway (the
streams it cut resume on the others: tests/faults/test_resume.py checks their text).

Forty streams start (each with its own prompt prefix, so all three workers get some); once thirty are
producing tokens one worker is SIGKILLed and the other 24 requests are sent at once, so some are routed
to the dead worker before the gateway notices (1 s without stats) and fail over. Every request must end
within the deadline as `completed` (all its tokens), `refused` before the first token with a retryable
503, or with a retryable SSE `error` event; never a hang or a dropped connection. Then the books must
balance to the token: no lease left in Redis, the tenant's token bucket back to its starting level plus
the refill minus exactly the tokens the clients received (prompt + completion of every request that got
a token; nothing for one that failed before its first), the day's metering counters grown by the same,
and no ERROR line in the gateway's JSON log without a request id.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from tenancy.redis_client import sync_client
from tenancy.schema import leases_key, usage_key
from tests.admission_stack import bucket_level, set_bucket
from tests.faults.client import StreamResult, completion_body, metric, stream_completion
from tests.faults.cluster import FaultCluster, unattributed_errors

pytestmark = pytest.mark.timeout(480)  # includes the shared cluster start-up
TENANT, TPM, START_LEVEL = "wk-tenant", 6_000_000, 1_000_000.0  # no clamp at TPM within the test
FIRST_WAVE, SECOND_WAVE, MAX_TOKENS, PROMPT_LEN = 40, 24, 48, 20
RETRYABLE_503 = {"worker_unavailable", "no_live_worker"}



def prompt(i: int) -> list[int]:
    return [1000 + (97 * i + j) % 40_000 for j in range(PROMPT_LEN)]


def check_outcome(res: StreamResult) -> str:
    if res.outcome == "completed":
        assert res.tokens == MAX_TOKENS and res.usage and res.usage["completion_tokens"] == MAX_TOKENS, res
        return "completed"
    if res.outcome == "refused":
        assert res.status == 503 and res.code in RETRYABLE_503 and res.headers.get("retry-after"), res
        return "refused_retryable"
    assert res.outcome == "error_event", f"stream cut or unfinished: {res}"
    assert res.code == "worker_unavailable" and res.error and res.error["type"] == "server_error", res
    return "error_event"


async def test_sigkill_worker_during_64_streams(cluster: FaultCluster) -> None:
    key = cluster.create_tenant(TENANT, tpm=TPM, rpm=0, max_concurrent=200)
    gw, victim = cluster.gateways[0], cluster.workers[1]
    r = sync_client(cluster.redis.url)
    try:
        day = time.strftime("%Y%m%d", time.gmtime())
        usage_before = {k.decode(): int(v) for k, v in r.hgetall(usage_key(TENANT, day)).items()}
        set_bucket(r, TENANT, START_LEVEL, 0)
        level0, t0 = bucket_level(r, TENANT, TPM)
        failovers0 = metric(gw.base_url, "switchyard_router_fallbacks_total", 'reason="failover"')
        resumes0 = metric(gw.base_url, "switchyard_router_resumes_total", 'reason="worker_lost"')
        started = asyncio.Semaphore(0)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as http:

            def launch(i: int) -> asyncio.Task[StreamResult]:
                body = completion_body(prompt(i), MAX_TOKENS)
                return asyncio.create_task(stream_completion(http, gw.base_url, key, body, started))

            tasks = [launch(i) for i in range(FIRST_WAVE)]
            async with asyncio.timeout(90):
                for _ in range(30):
                    await started.acquire()
            victim.proc.kill()
            killed_at = time.monotonic()
            tasks += [launch(i) for i in range(FIRST_WAVE, FIRST_WAVE + SECOND_WAVE)]
            done, pending = await asyncio.wait(tasks, timeout=120)
            assert not pending, f"{len(pending)} requests hung"
            ended_after = time.monotonic() - killed_at
        results = [t.result() for t in tasks]
        outcomes = Counter(check_outcome(res) for res in results)
        failovers = metric(gw.base_url, "switchyard_router_fallbacks_total", 'reason="failover"') - failovers0
        print(f"outcomes {dict(outcomes)}, gateway failovers {failovers:.0f}, all ended {ended_after:.1f}s "
              f"after the kill")
        assert sum(outcomes.values()) == FIRST_WAVE + SECOND_WAVE
        # the streams it cut carried on elsewhere (resume mid-stream): an error event only past max_resumes
        resumes = metric(gw.base_url, "switchyard_router_resumes_total", 'reason="worker_lost"') - resumes0
        assert resumes >= 1, "the kill hit no running stream"
        assert outcomes["completed"] >= FIRST_WAVE + SECOND_WAVE - outcomes["error_event"] - 4

        # every reservation settled: no lease left, the bucket down by exactly what was delivered
        deadline = time.monotonic() + 3
        while r.zcard(leases_key(TENANT)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert r.zcard(leases_key(TENANT)) == 0, "leases left after every request ended"
        level1, t1 = bucket_level(r, TENANT, TPM)
        served = [res for res in results if res.tokens > 0]
        used = sum(PROMPT_LEN + res.tokens for res in served)
        refill = (t1 - t0) * TPM / 60e6
        assert level1 == pytest.approx(level0 + refill - used, abs=1.0)
        usage = {k.decode(): int(v) for k, v in r.hgetall(usage_key(TENANT, day)).items()}
        grown = {k: usage.get(k, 0) - usage_before.get(k, 0) for k in ("requests", "prompt_tokens",
                                                                        "completion_tokens")}
        assert grown == {"requests": len(served), "prompt_tokens": PROMPT_LEN * len(served),
                         "completion_tokens": sum(res.tokens for res in served)}
    finally:
        r.close()

    # the gateway serves on the survivors, and logged no error without its request id
    async with httpx.AsyncClient(timeout=60) as http:
        after = await stream_completion(http, gw.base_url, key, completion_body(prompt(999), 4))
    assert after.outcome == "completed", after
    assert gw.proc.poll() is None
    assert unattributed_errors(gw) == []
