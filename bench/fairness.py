"""Benchmark: fair share between two tenants on one worker, VTC against FIFO, in one run.

For each policy (`--policies`, default vtc then fifo) it starts a private stack (redis, one worker with
`--fairness <policy>` and a metrics port, one gateway whose capacity queue is fair for vtc and one FIFO for
fifo) with tenant `heavy` (no rate or concurrency limit, so a flood stays within its quota) and tenant
`light`. The first stack measures capacity: requests of the heavy shape per second with `--max-num-seqs` in
flight, then `light` alone, open-loop Poisson at `--light-load` x capacity, for `--duration` s (one key: both
policies order it the same, so it is measured once). Then, per policy: `light` again while `heavy` floods at
`--heavy-load` x capacity. Light's TTFT p50/p99 come from its streams; throughput is the growth of the
worker's generated-token counter over the flood. Prompts are seeded, so both policies see the same
requests. `--weights` (default) adds a phase under vtc: tenants of weight 2 and 1 both backlogged. One line:

    {"light_ttft_p99_ratio_fair", "light_ttft_p99_ratio_fifo", "throughput_ratio_vs_fifo",
     "weighted_service_ratio", ...details}

Targets: ratio_fair <= 1.5, throughput_ratio_vs_fifo >= 0.95, weighted_service_ratio 2 +- 10% (those of the
policies and phases run); exits 1 when one is missed (`--no-targets`: 0).
About 5 minutes with the defaults on an idle 2-core machine.

    .venv/bin/python -m bench.fairness --json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.machine import add_no_targets, cpu_model, emit, machine_fields
from config.loadtest.loadgen import WORDS, RequestRecord, RequestSpec, api_base, discover_model, send_request
from config.loadtest.report import latency_stats_ms
from config.local_stack.launcher import Stack, StackConfig, free_port

UNLIMITED = {"tpm": 0, "rpm": 0, "max_concurrent": 0}


@dataclass(slots=True)
class Tenant:
    key: str
    client: httpx.AsyncClient
    words: int  # prompt length in words
    rng: random.Random

    def spec(self, index: int, max_tokens: int) -> RequestSpec:
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.words))
        return RequestSpec(index, [{"role": "user", "content": f"Request {index}: {text}"}], max_tokens)


@dataclass(slots=True)
class Env:
    base: str
    model: str
    metrics_url: str
    args: argparse.Namespace


# ---------------------------------------------------------------- stack

def start_stack(args: argparse.Namespace, policy: str, log_dir: Path) -> tuple[Stack, str]:
    # the gateway's capacity queue follows the policy: fair across tenants for vtc, one FIFO for fifo
    os.environ["SWITCHYARD_GATEWAY__CAPACITY_FAIR_QUEUE"] = "false" if policy == "fifo" else "true"
    mport = free_port()
    wargs = ["--model", args.model, *(["--fairness", policy] if policy != "none" else []),
             "--metrics-port", str(mport), "--metrics-host", "127.0.0.1",
             "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_batched_tokens),
             "--num-threads", str(args.threads), *(["--dtype", args.dtype] if args.dtype else [])]
    # the gateway tokenizes with the default model's tokenizer whatever the worker runs (as in the tests)
    stack = Stack(StackConfig(port=free_port(), log_dir=log_dir / policy,
                              ready_timeout=args.ready_timeout, worker_args=wargs,
                              gateway_args=["--worker-timeout", "60"]))
    stack.start()
    return stack, f"http://127.0.0.1:{mport}/metrics"


def worker_metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(url, timeout=10)).text
    names = ("generated_tokens_total", "waiting_requests", "running_requests")
    return {n: worker_metric(text, "switchyard_worker_" + n) for n in names}


async def wait_idle(client: httpx.AsyncClient, url: str, timeout: float = 120.0) -> None:
    """Until the worker has nothing waiting or running (aborted floods drain within a step or two)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await scrape(client, url)
        if m["waiting_requests"] == 0 and m["running_requests"] == 0:
            return
        await asyncio.sleep(0.5)
    raise TimeoutError("the worker did not go idle")


# ---------------------------------------------------------------- load

async def open_loop(env: Env, t: Tenant, rate: float, until: float, tasks: list[asyncio.Task]) -> None:
    """Poisson arrivals at `rate` requests/s until loop time `until`; each request is a task in `tasks`."""
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    i = 0
    while True:
        await asyncio.sleep(t.rng.expovariate(rate))
        if loop.time() >= until:
            return
        spec = t.spec(i, env.args.max_tokens)
        tasks.append(asyncio.create_task(send_request(t.client, env.base + "/chat/completions",
                                                      env.model, spec, start, env.args.request_timeout)))
        i += 1


async def closed_loop(env: Env, t: Tenant, concurrency: int, until: float) -> list[RequestRecord]:
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    records: list[RequestRecord] = []
    counter = iter(range(1 << 30))

    async def lane() -> None:
        while loop.time() < until:
            spec = t.spec(next(counter), env.args.max_tokens)
            records.append(await send_request(t.client, env.base + "/chat/completions", env.model, spec,
                                              start, env.args.request_timeout))

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return records


async def finish(tasks: list[asyncio.Task], wait_s: float) -> list[RequestRecord]:
    """Records of the tasks done within `wait_s`; the rest are cancelled (the gateway aborts them)."""
    if tasks:
        await asyncio.wait(tasks, timeout=wait_s)
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [r for r in results if isinstance(r, RequestRecord)]


def errors(records: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            out[r.error] = out.get(r.error, 0) + 1
    return out


# ---------------------------------------------------------------- phases

async def calibrate(env: Env, heavy: Tenant) -> float:
    """Completed heavy-shaped requests per second with `max_num_seqs` in flight."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    records = await closed_loop(env, heavy, env.args.max_num_seqs, t0 + env.args.calibrate_s)
    done = sum(r.ok for r in records)
    return done / max(loop.time() - t0, 1e-9)


async def phase(env: Env, light: Tenant, heavy: Tenant | None, capacity: float) -> dict:
    """Light at its rate for `duration` s, alone or beside heavy's flood; light's TTFT and the throughput."""
    loop = asyncio.get_running_loop()
    args = env.args
    async with httpx.AsyncClient() as probe:
        await wait_idle(probe, env.metrics_url)
        before = await scrape(probe, env.metrics_url)
        t0 = loop.time()
        until = t0 + args.duration
        light_tasks: list[asyncio.Task] = []
        heavy_tasks: list[asyncio.Task] = []
        feeders = [open_loop(env, light, args.light_load * capacity, until, light_tasks)]
        if heavy is not None:
            feeders.append(open_loop(env, heavy, args.heavy_load * capacity, until, heavy_tasks))
        await asyncio.gather(*feeders)
        after = await scrape(probe, env.metrics_url)
        elapsed = loop.time() - t0
        # heavy keeps its streams (the flood goes on) until light's last requests are served
        light_records = await finish(light_tasks, args.request_timeout)
        heavy_records = await finish(heavy_tasks, 0.0)
    ttft = [r.ttft for r in light_records if r.ok and r.ttft is not None]
    out = {"light_ttft_ms": latency_stats_ms(ttft), "light_requests": len(light_records),
           "light_errors": errors(light_records),
           "tokens_per_s": round((after["generated_tokens_total"] - before["generated_tokens_total"])
                                 / elapsed, 2)}
    if heavy is not None:
        out.update(heavy_requests=len(heavy_records), heavy_errors=errors(heavy_records),
                   heavy_completed=sum(r.ok for r in heavy_records),
                   heavy_completed_per_s=round(sum(r.ok for r in heavy_records) / elapsed, 3))
    return out


async def weighted(env: Env, w2: Tenant, w1: Tenant) -> dict:
    """Both tenants backlogged (closed loops of `max_num_seqs` each): service w_p*prefill + w_d*decode."""
    loop = asyncio.get_running_loop()
    until = loop.time() + env.args.duration
    r2, r1 = await asyncio.gather(*(closed_loop(env, t, env.args.max_num_seqs, until) for t in (w2, w1)))

    def service(records: list[RequestRecord]) -> float:
        return sum((r.prompt_tokens - r.cached_tokens) + 2 * r.completion_tokens for r in records if r.ok)

    s2, s1 = service(r2), service(r1)
    return {"service_weight2": s2, "service_weight1": s1,
            "weighted_service_ratio": round(s2 / s1, 3) if s1 else None}


# ---------------------------------------------------------------- runs

def tenant(stack: Stack, name: str, words: int, seed: int, **fields: object) -> Tenant:
    key = stack.create_tenant(name, **UNLIMITED, **fields)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    client = httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=None)
    return Tenant(key, client, words, random.Random(seed))


async def run_policy(stack: Stack, metrics_url: str, policy: str, args: argparse.Namespace,
                     capacity: float | None) -> tuple[dict, float]:
    base = api_base(stack.base_url)
    heavy = tenant(stack, "heavy", args.heavy_words, args.seed)
    light = tenant(stack, "light", args.light_words, args.seed + 1)
    clients = [heavy.client, light.client]
    try:
        env = Env(base, await discover_model(heavy.client, base, 30.0), metrics_url, args)
        out: dict = {}
        # the first policy: capacity, and light alone (one key: the same for all policies)
        if capacity is None:
            capacity = await calibrate(env, heavy)
            out["alone"] = await phase(env, light, None, capacity)
        # reseeded: both policies replay the same requests in the flood phase
        light.rng, heavy.rng = random.Random(args.seed + 1), random.Random(args.seed + 2)
        out["flood"] = await phase(env, light, heavy, capacity)
        if args.weights and policy == "vtc":
            w2 = tenant(stack, "weight2", args.heavy_words, args.seed + 3, weight=2)
            w1 = tenant(stack, "weight1", args.heavy_words, args.seed + 4, weight=1)
            clients += [w2.client, w1.client]
            out["weights"] = await weighted(env, w2, w1)
        return out, capacity
    finally:
        for client in clients:
            await client.aclose()


def ratios(results: dict[str, dict]) -> dict:
    alone = next(r["alone"]["light_ttft_ms"]["p99"] for r in results.values() if "alone" in r)

    def p99_ratio(policy: str) -> float | None:
        r = results.get(policy)
        if r is None:
            return None
        flood = r["flood"]["light_ttft_ms"]["p99"]
        return round(flood / alone, 3) if alone and flood is not None else None

    out = {"light_ttft_p99_ratio_fair": p99_ratio("vtc"), "light_ttft_p99_ratio_fifo": p99_ratio("fifo")}
    if "vtc" in results and "fifo" in results:
        fifo_tps = results["fifo"]["flood"]["tokens_per_s"]
        out["throughput_ratio_vs_fifo"] = (round(results["vtc"]["flood"]["tokens_per_s"] / fifo_tps, 3)
                                           if fifo_tps else None)
    if "weights" in results.get("vtc", {}):
        out["weighted_service_ratio"] = results["vtc"]["weights"]["weighted_service_ratio"]
    return out


def targets_met(out: dict, fair: bool, fifo: bool) -> dict[str, bool]:
    """The targets of what ran (`fair`: VTC, `fifo`: FIFO; the weights phase when its ratio is there): light
    tenant's TTFT p99 flooded <= 1.5x alone, throughput >= 0.95x FIFO, weight-2 service 2x +- 10%; a measure
    that came out None misses."""
    checks = {"light_ttft_p99_ratio_fair": (fair, lambda v: v <= 1.5),
              "throughput_ratio_vs_fifo": (fair and fifo, lambda v: v >= 0.95),
              "weighted_service_ratio": ("weighted_service_ratio" in out, lambda v: 1.8 <= v <= 2.2)}
    return {k: out.get(k) is not None and ok(out[k]) for k, (ran, ok) in checks.items() if ran}


def bench(args: argparse.Namespace, log_dir: Path) -> dict:
    if not args.gateway_capacity:
        os.environ["SWITCHYARD_GATEWAY__CAPACITY_ADMISSION"] = "false"
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    capacity: float | None = None
    for policy in args.policies.split(","):
        stack, metrics_url = start_stack(args, policy, log_dir)
        try:
            results[policy], capacity = asyncio.run(run_policy(stack, metrics_url, policy, args, capacity))
        finally:
            stack.stop()
    out = ratios(results)
    return {**out, "met": targets_met(out, "vtc" in results, "fifo" in results),
            "capacity_rps": round(capacity or 0.0, 3), "policies": results,
            "model": args.model, "dtype": args.dtype or "auto", "threads": args.threads, "cpu": cpu_model(),
            "duration_s": args.duration, "heavy_load": args.heavy_load, "light_load": args.light_load,
            "gateway_capacity": args.gateway_capacity, "max_num_seqs": args.max_num_seqs,
            "max_batched_tokens": args.max_batched_tokens, "max_tokens": args.max_tokens,
            **machine_fields(load_before)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = ap.add_argument
    a("--json", action="store_true", help="print only the JSON line")
    add_no_targets(ap)
    a("--model", default="default", help="worker model spec ('default', 'tiny-random', path)")
    a("--dtype", default=None)
    a("--threads", type=int, default=2, help="torch threads of the worker")
    a("--policies", default="vtc,fifo",
      help="comma-separated worker fairness policies, run in this order ('none': the worker's default)")
    a("--duration", type=float, default=45.0, help="seconds of each phase")
    a("--calibrate-s", type=float, default=15.0, help="seconds of the capacity measurement")
    a("--heavy-load", type=float, default=4.0, help="heavy tenant's offered load, x capacity")
    a("--light-load", type=float, default=0.1, help="light tenant's offered load, x capacity")
    a("--heavy-words", type=int, default=200, help="heavy prompts, in words")
    a("--light-words", type=int, default=40, help="light prompts, in words")
    a("--max-tokens", type=int, default=32)
    a("--max-num-seqs", type=int, default=16)
    a("--max-batched-tokens", type=int, default=512)
    a("--request-timeout", type=float, default=300.0)
    a("--weights", action=argparse.BooleanOptionalAction, default=True,
      help="also measure a weight-2 against a weight-1 tenant (vtc)")
    a("--gateway-capacity", action=argparse.BooleanOptionalAction, default=True,
      help="keep the gateway's KV-capacity admission (its queue is fair for vtc, FIFO for fifo)")
    a("--seed", type=int, default=1)
    a("--ready-timeout", type=float, default=240.0)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the stacks
    with tempfile.TemporaryDirectory(prefix="sy-bench-fairness-") as tmp:
        result = bench(args, Path(tmp))
    return emit(result, args.json, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
