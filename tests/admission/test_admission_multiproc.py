"""Exactness across processes: 4 OS processes (like 4 gateway replicas) hammer one tenant's budget."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest

from tenancy import tenant_admin as store
from tenancy.redis_client import sync_client
from tenancy.schema import bucket_key

pytestmark = pytest.mark.timeout(60)
PROCS = 4


def _hammer(url: str, cost: int, hold_s: float, seconds: float, queue, ready, go) -> None:
    asyncio.run(_hammer_async(url, cost, hold_s, seconds, queue, ready, go))


async def _hammer_async(url: str, cost: int, hold_s: float, seconds: float, queue, ready, go) -> None:
    from admission.budget import Budget
    from admission.results import QuotaExceeded
    from tenancy.directory import TenantDirectory  # noqa: F401  (import cost paid before the start barrier)
    from tenancy.redis_client import async_client

    client = async_client(url)
    budget = Budget(client)
    r = sync_client(url)
    tenant = store.get_tenant(r, "acme")
    r.close()
    ready.wait(timeout=30)  # every process is set up
    go.wait(timeout=30)  # all start together, and only after the parent has read the clock
    admitted_tokens, admitted, max_active, denied = 0, 0, 0, 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def one() -> None:
        nonlocal admitted_tokens, admitted, max_active, denied
        while loop.time() < deadline:
            try:
                res = await budget.reserve(tenant, cost // 2, cost - cost // 2)
            except QuotaExceeded:
                denied += 1
                await asyncio.sleep(0.002)
                continue
            admitted += 1
            admitted_tokens += cost
            max_active = max(max_active, res.result.active_concurrent)
            if hold_s:
                await asyncio.sleep(hold_s)
                res.record(completion_tokens=cost - cost // 2)  # used everything: no refund
                await budget.settle(res)

    await asyncio.gather(*(one() for _ in range(8)))
    await client.aclose()
    queue.put((admitted_tokens, admitted, max_active, denied))


def _run(url: str, cost: int, hold_s: float, seconds: float) -> tuple[list[tuple[int, int, int, int]], float]:
    """Results per process and the Redis-clock seconds from the common start to the end."""
    ctx = mp.get_context("spawn")
    queue, ready, go = ctx.Queue(), ctx.Barrier(PROCS + 1), ctx.Barrier(PROCS + 1)
    procs = [ctx.Process(target=_hammer, args=(url, cost, hold_s, seconds, queue, ready, go))
             for _ in range(PROCS)]
    for p in procs:
        p.start()
    r = sync_client(url)
    try:
        ready.wait(timeout=30)
        # read before the go barrier: no process can spend before t0, however late this runs
        t0 = _redis_time_s(r)
        go.wait(timeout=30)
        results = [queue.get(timeout=40) for _ in procs]
        elapsed = _redis_time_s(r) - t0
    finally:
        r.close()
        for p in procs:
            p.join(timeout=10)
    assert all(p.exitcode == 0 for p in procs)
    return results, elapsed


def _redis_time_s(r) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


def test_token_budget_exact_across_processes(redis_url):
    r = sync_client(redis_url)
    budget = 20_000
    store.create_tenant(r, "acme", tpm=budget, rpm=0, max_concurrent=0)
    results, elapsed = _run(redis_url, cost=100, hold_s=0.0, seconds=1.5)
    tokens = sum(x[0] for x in results)
    refill = budget * elapsed / 60  # continuous refill during the test window
    assert all(x[3] > 0 for x in results)  # every process hit the limit
    assert tokens <= budget + refill
    assert tokens >= 0.95 * budget
    level = float(r.hget(bucket_key("acme"), "tok"))
    assert 0 <= level < 100  # what is left is less than one request's cost
    r.close()


def test_requests_and_concurrency_exact_across_processes(redis_url):
    r = sync_client(redis_url)
    store.create_tenant(r, "acme", tpm=0, rpm=0, max_concurrent=5)
    results, _ = _run(redis_url, cost=10, hold_s=0.01, seconds=1.0)
    assert max(x[2] for x in results) == 5  # never more than 5 leases at once, and the limit was reached
    assert sum(x[1] for x in results) > 20
    r.close()

    r = sync_client(redis_url)
    r.flushall()
    store.create_tenant(r, "acme", tpm=0, rpm=300, max_concurrent=0)
    results, elapsed = _run(redis_url, cost=10, hold_s=0.0, seconds=1.0)
    admitted = sum(x[1] for x in results)
    assert 0.95 * 300 <= admitted <= 300 + 300 * elapsed / 60
    r.close()
