"""Benchmark of the admission path alone: authenticate + budget reserve + settle.

N processes (like N gateways) share one tenant; prints latency, Redis round trips per request and
`over_admit_frac` (target: 0.0; exits 1 otherwise). Run: `.venv/bin/python -m bench.admission --json`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import re
import sys
import time
from pathlib import Path

from admission.lua.scripts import RESERVE, SETTLE
from bench.machine import add_no_targets, exit_code
from config.local_stack.launcher import start_redis_server
from tenancy import create_tenant, issue_key, revoke_key, sync_client

TENANT = "bench"
COST = 100  # prompt 40 + max_tokens 60; every request uses all of it (no refund), so the budget is exact


def _worker(url: str, key: str, n: int, inflight: int, barrier, queue) -> None:
    asyncio.run(_worker_async(url, key, n, inflight, barrier, queue))


async def _worker_async(url: str, key: str, n: int, inflight: int, barrier, queue) -> None:
    from admission import Budget, QuotaExceeded
    from tenancy import TenantDirectory, async_client

    client = async_client(url)
    directory = TenantDirectory(client)
    budget = Budget(client)
    tenant = await directory.authenticate(key)  # warm-up: connection, cache, script load
    assert tenant is not None
    await client.ping()
    barrier.wait(timeout=60)  # ready; then go once the parent has read the counters
    barrier.wait(timeout=60)
    latencies: list[int] = []
    admitted = denied = 0
    remaining = n

    async def loop() -> None:
        nonlocal admitted, denied, remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter_ns()
            t = await directory.authenticate(key)
            try:
                res = await budget.reserve(t, 40, 60)
            except QuotaExceeded:
                denied += 1
            else:
                res.record(completion_tokens=60)
                await budget.settle(res)
                admitted += 1
            latencies.append((time.perf_counter_ns() - t0) // 1000)

    await asyncio.gather(*(loop() for _ in range(inflight)))
    await client.aclose()
    queue.put((latencies, admitted, denied))


def _script_commands() -> set[str]:
    """Commands our Lua scripts run inside Redis: commandstats counts them, but they are no round trips."""
    lua = Path(__file__).resolve().parents[1] / "admission" / "lua"
    names = set()
    for path in lua.glob("*.lua"):
        names |= {m.lower() for m in re.findall(r"redis\.call\('(\w+)'", path.read_text())}
    return names


def _client_calls(r, internal: set[str]) -> int:
    """Commands sent by clients (one round trip each), from INFO commandstats; INFO itself excluded."""
    total = 0
    for key, stats in r.info("commandstats").items():
        name = key.removeprefix("cmdstat_")
        if name != "info" and name not in internal:
            total += stats["calls"]
    return total


def spawn_workers(url: str, key: str, procs: int, requests: int,
                  inflight: int) -> tuple[list, object, object]:
    """`procs` client processes sharing `requests`, each `inflight` at a time; they wait at the barrier twice
    (started, then counters read) before sending. Returns (processes, barrier, result queue)."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(procs + 1), ctx.Queue()
    share = [requests // procs + (1 if i < requests % procs else 0) for i in range(procs)]
    workers = [ctx.Process(target=_worker, args=(url, key, share[i], inflight, barrier, queue))
               for i in range(procs)]
    for w in workers:
        w.start()
    return workers, barrier, queue


def run(url: str, procs: int, requests: int, inflight: int, budget_tokens: int) -> dict:
    r = sync_client(url)
    stale = list(r.scan_iter(match="{t:" + TENANT + "}*"))  # a previous run's tenant, if any
    if stale:
        r.delete(*stale)
    create_tenant(r, TENANT, tpm=budget_tokens, rpm=0, max_concurrent=0)
    key = issue_key(r, TENANT)
    for script in (RESERVE, SETTLE):  # as a gateway would at start-up: no NOSCRIPT in the measured phase
        r.script_load(script.source)
    internal = _script_commands()
    workers, barrier, queue = spawn_workers(url, key, procs, requests, inflight)
    try:
        barrier.wait(timeout=60)
        calls0, (s0, us0) = _client_calls(r, internal), r.time()
        barrier.wait(timeout=60)
        results = [queue.get(timeout=300) for _ in workers]
        calls1, (s1, us1) = _client_calls(r, internal), r.time()
    finally:
        for w in workers:
            w.join(timeout=10)
    elapsed = (s1 + us1 / 1e6) - (s0 + us0 / 1e6)
    latencies = sorted(x for res in results for x in res[0])
    admitted = sum(res[1] for res in results)
    allowed = budget_tokens + budget_tokens * elapsed / 60  # the bucket plus its continuous refill
    over = max(0.0, admitted * COST - allowed) / budget_tokens
    revoke_key(r, key)
    r.close()
    return {
        "processes": procs, "requests": len(latencies), "admitted": admitted,
        "denied": sum(res[2] for res in results), "budget_tokens": budget_tokens,
        "admitted_tokens": admitted * COST, "elapsed_s": round(elapsed, 3),
        "redis_round_trips_per_request": round((calls1 - calls0 - 1) / max(1, len(latencies)), 3),
        "p50_us": latencies[len(latencies) // 2],
        "p99_us": latencies[min(len(latencies) - 1, len(latencies) * 99 // 100)],
        "over_admit_frac": round(over, 6),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of starting a private one")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--inflight", type=int, default=4, help="concurrent requests per process")
    ap.add_argument("--budget-tokens", type=int, default=100_000,
                    help="tenant tokens/min (default: half the offered load of 2000 x 100 tokens)")
    ap.add_argument("--json", action="store_true")
    add_no_targets(ap)
    args = ap.parse_args(argv)
    if args.processes < 1 or args.requests < 1 or args.inflight < 1 or args.budget_tokens < COST:
        ap.error("processes, requests, inflight must be >= 1 and budget-tokens >= 100")
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis_server()
    try:
        result = run(url, args.processes, args.requests, args.inflight, args.budget_tokens)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    result["met"] = {"over_admit_frac": result["over_admit_frac"] == 0}
    if not args.json:
        for k, v in result.items():
            print(f"{k:32} {v}", file=sys.stderr)
    print(json.dumps(result))
    return exit_code(result, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
