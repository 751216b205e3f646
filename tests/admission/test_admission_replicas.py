"""Issue 6 acceptance, exactness across replicas: 4 real gateway processes share one tenant's budget in
Redis. 200 concurrent requests of known cost (token-id prompts, `ignore_eos`, so usage equals the
reservation and nothing is refunded) spread over the 4 gateways: tokens and requests admitted stay
within the per-minute budget (plus the refill during the run, read on the Redis clock) and reach at
least 95% of it; concurrency never exceeds the limit, sampled in the Redis leases zset and in the
worker's own count of running + queued requests.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from router.links.client import WorkerClient
from tenancy.redis_client import sync_client
from tenancy.schema import leases_key
from tests.admission_stack import AdmissionStack

# a stack of its own and a long scenario: `make test-heavy`, its own CI step
pytestmark = [pytest.mark.timeout(120), pytest.mark.heavy]
REPLICAS = 4
REQUESTS = 200


@pytest.fixture(scope="module")
def stack() -> Iterator[AdmissionStack]:
    s = AdmissionStack.start(gateways=REPLICAS)
    try:
        s.warm_up(REQUESTS // REPLICAS)
        yield s
    finally:
        s.stop()


def _redis_s(r) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


async def _burst(stack: AdmissionStack, key: str, prompt: list[int],
                 max_tokens: int) -> tuple[Counter, float]:
    """REQUESTS concurrent requests, round-robin over the gateways: outcome counts and Redis-clock seconds.

    Every response must be a 200 or a 429 `rate_limit_exceeded` (counted by its error type)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = sync_client(stack.redis.url)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=REQUESTS)) as http:
        async def one(i: int) -> str:
            url = stack.gateways[i % REPLICAS].base_url + "/v1/completions"
            resp = await http.post(url, json=body, headers={"authorization": f"Bearer {key}"})
            if resp.status_code == 200:
                assert resp.json()["usage"]["completion_tokens"] == max_tokens
                return "ok"
            assert resp.status_code == 429, resp.text
            assert resp.json()["error"]["code"] == "rate_limit_exceeded"
            return resp.json()["error"]["type"]

        t0 = _redis_s(r)
        outcomes = Counter(await asyncio.gather(*(one(i) for i in range(REQUESTS))))
        elapsed = _redis_s(r) - t0
    r.close()
    return outcomes, elapsed


async def test_token_budget_exact_across_four_gateways(stack):
    budget, cost = 5000, 50  # 100 requests' worth; 200 are sent
    key = stack.create_tenant("tokens", tpm=budget, rpm=0, max_concurrent=0)
    outcomes, elapsed = await _burst(stack, key, list(range(100, 149)), 1)  # 49 + 1 = 50 tokens, all used
    admitted = outcomes["ok"] * cost
    assert outcomes["tokens"] > 0  # the limit was hit
    assert admitted <= budget + budget * elapsed / 60, (outcomes, elapsed)
    assert admitted >= 0.95 * budget, outcomes


async def test_request_budget_exact_across_four_gateways(stack):
    rpm = 100
    key = stack.create_tenant("requests", tpm=0, rpm=rpm, max_concurrent=0)
    outcomes, elapsed = await _burst(stack, key, list(range(100, 105)), 1)
    assert outcomes["requests"] > 0
    assert 0.95 * rpm <= outcomes["ok"] <= rpm + rpm * elapsed / 60, (outcomes, elapsed)


async def test_concurrency_limit_never_exceeded_across_four_gateways(stack):
    limit, clients, seconds = 6, 40, 4.0
    key = stack.create_tenant("conc", tpm=0, rpm=0, max_concurrent=limit)
    body = {"model": "default", "prompt": list(range(100, 120)), "max_tokens": 20, "ignore_eos": True}
    observer = WorkerClient(stack.worker.endpoint, gateway_id=f"replicas-observer-{time.monotonic_ns()}",
                            worker_timeout=5.0)
    await observer.start()
    await observer.wait_ready(30)
    r = sync_client(stack.redis.url)
    seen_leases, seen_worker, served = [], [], Counter()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    try:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as http:
            async def client(i: int) -> None:
                url = stack.gateways[i % REPLICAS].base_url + "/v1/completions"
                while loop.time() < deadline:
                    resp = await http.post(url, json=body, headers={"authorization": f"Bearer {key}"})
                    assert resp.status_code in (200, 429), resp.text
                    served[resp.status_code] += 1
                    if resp.status_code == 429:
                        await asyncio.sleep(0.02)

            async def sample() -> None:
                while loop.time() < deadline:
                    seen_leases.append(await asyncio.to_thread(r.zcard, leases_key("conc")))
                    if observer.stats is not None:
                        seen_worker.append(observer.stats.running + observer.stats.queue)
                    await asyncio.sleep(0.01)

            await asyncio.gather(sample(), *(client(i) for i in range(clients)))
    finally:
        r.close()
        await observer.close()
    assert served[200] > limit and served[429] > 0
    assert max(seen_leases) == limit, Counter(seen_leases)  # reached, never exceeded
    assert 1 <= max(seen_worker) <= limit, Counter(seen_worker)
