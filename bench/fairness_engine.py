"""Benchmark: the fairness mechanism inside one engine (no HTTP, gateway or client load), VTC against FIFO.

The same scenario as bench/fairness.py in one process: open-loop Poisson arrivals on the wall clock, `light`
at `--light-load` x capacity alone, then beside `heavy` at `--heavy-load` x capacity, per policy; TTFT is from
a request's scheduled arrival to its first token, so time spent behind a step in flight counts, and also in
steps (1: the first step after arrival), which no machine load changes. Separates what the scheduler does
from what a loaded machine's gateway and client add. One JSON line:

    {"light_ttft_p99_ratio_fair", "light_ttft_p99_ratio_fifo", "throughput_ratio_vs_fifo",
     "light_ttft_p99_ms", "solo_ttft_p99_ms", "flood_step_ms_p99", "steps_waited_p99", "within_ttft_bound",
     "weighted_service_ratio", ...details}

The bound (VTC): the light tenant's p99 TTFT under the flood is at most its solo p99 plus one flood step's
p99 duration, and the p99 of the steps it waits is at most 2. Targets: that bound, throughput >= 0.95x FIFO
and (`--weights`) weight-2 service 2x +- 10%; exits 1 when one is missed (`--no-targets`: 0).

    .venv/bin/python -m bench.fairness_engine --json
"""

from __future__ import annotations

import argparse
import os
import random
import time

from bench.machine import add_no_targets, cpu_model, emit, machine_fields
from config.loadtest.report import latency_stats_ms
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.protocol import SamplingParams

HEAVY, LIGHT = b"heavy", b"light"


def arrivals(rng: random.Random, rate: float, duration: float) -> list[float]:
    out, t = [], 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)
    return out


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 40000) for _ in range(n)]


def make_engine(model, args: argparse.Namespace, policy: str) -> Engine:
    return Engine(model, EngineConfig(max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_batched_tokens,
                                      fairness=policy, fair_step_tokens=args.fair_step_tokens))


def calibrate(model, args: argparse.Namespace) -> float:
    """Heavy-shaped requests completed per second with `max_num_seqs` always in flight."""
    eng, rng = make_engine(model, args, "fifo"), random.Random(args.seed)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.max_num_seqs):
        eng.add_request(f"w{i}", tokens(rng, args.heavy_tokens), sp, fkey=HEAVY)
    generated, n, t0 = 0, args.max_num_seqs, time.perf_counter()
    while time.perf_counter() - t0 < args.calibrate_s:
        for out in eng.step():
            generated += len(out.new_tokens)
            if out.finish_reason is not None:
                eng.add_request(f"w{n}", tokens(rng, args.heavy_tokens), sp, fkey=HEAVY)
                n += 1
    rate = generated / args.max_tokens / (time.perf_counter() - t0)  # requests' worth of output tokens
    eng.close()
    return rate


def phase(model, args: argparse.Namespace, policy: str, capacity: float, flood: bool) -> dict:
    rng = random.Random(args.seed + 1)
    sched = [(t, LIGHT, f"l{i}")
             for i, t in enumerate(arrivals(rng, args.light_load * capacity, args.duration))]
    if flood:
        sched += [(t, HEAVY, f"h{i}")
                  for i, t in enumerate(arrivals(rng, args.heavy_load * capacity, args.duration))]
    sched.sort()
    prompts = {rid: tokens(rng, args.light_tokens if key == LIGHT else args.heavy_tokens)
               for _, key, rid in sched}
    eng = make_engine(model, args, policy)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    due: dict[str, float] = {}
    due_step: dict[str, int] = {}
    ttft: list[float] = []
    steps: list[int] = []  # steps started after arrival, up to the first token (1: the next step)
    step_s: list[float] = []  # each step's duration
    generated = n_steps = 0
    i, t0 = 0, time.perf_counter()
    light_left = sum(1 for _, key, _ in sched if key == LIGHT)
    while light_left:
        now = time.perf_counter() - t0
        if now > args.duration + args.max_wait_s:  # bounded: the rest count as waiting this long (censored)
            ttft += [now - due[rid] for rid in due if rid.startswith("l")]
            break
        while i < len(sched) and sched[i][0] <= now:
            at, key, rid = sched[i]
            eng.add_request(rid, prompts[rid], sp, fkey=key)
            due[rid], due_step[rid] = at, n_steps
            i += 1
        if not eng.has_work():
            time.sleep(max(0.0, min(sched[i][0] - now, 0.05)) if i < len(sched) else 0.0)
            continue
        started = time.perf_counter()
        outs = eng.step()
        n_steps += 1
        step_s.append(time.perf_counter() - started)
        end = time.perf_counter() - t0
        for out in outs:
            if end < args.duration:
                generated += len(out.new_tokens)
            at = due.pop(out.rid, None)
            if at is not None and out.rid.startswith("l"):
                ttft.append(end - at)
                steps.append(n_steps - due_step[out.rid])
                light_left -= 1
    eng.close()
    steps.sort()
    return {"light_ttft_ms": latency_stats_ms(ttft), "light_requests": len(ttft),
            "light_ttft_steps_p50_max": [steps[len(steps) // 2], steps[-1]] if steps else None,
            "steps_waited_p99": steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else None,
            "step_ms_p99": latency_stats_ms(step_s)["p99"],
            "tokens_per_s": round(generated / args.duration, 2), "preemptions": eng.stats().preemptions}


def weighted(model, args: argparse.Namespace) -> dict:
    """Both keys backlogged (enough requests queued for the whole
    phase): service ratio weight 2 / weight 1."""
    eng, rng = make_engine(model, args, "vtc"), random.Random(args.seed + 2)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(4 * args.max_num_seqs):
        eng.add_request(f"a{i}", tokens(rng, args.heavy_tokens), sp, fkey=b"w2", weight=2.0)
        eng.add_request(f"b{i}", tokens(rng, args.heavy_tokens), sp, fkey=b"w1", weight=1.0)
    t0 = time.perf_counter()
    fair = eng.scheduler.fair
    while time.perf_counter() - t0 < args.weights_s and fair.active_requests(b"w1") > args.max_num_seqs \
            and fair.active_requests(b"w2") > args.max_num_seqs:
        eng.step()
    s2, s1 = fair.service(b"w2"), fair.service(b"w1")
    eng.close()
    return {"service_weight2": s2, "service_weight1": s1,
            "weighted_service_ratio": round(s2 / s1, 3) if s1 else None}


def bench(args: argparse.Namespace) -> dict:
    import torch

    from worker.model.loader import load_any

    torch.set_num_threads(args.threads)
    model = load_any(args.model, dtype=args.dtype)
    warm = make_engine(model, args, "fifo")  # kernels built and loaded before any clock starts
    warm.generate([tokens(random.Random(0), args.heavy_tokens)],
                  SamplingParams(max_tokens=2, ignore_eos=True))
    warm.close()
    load_before = os.getloadavg()
    capacity = calibrate(model, args)
    alone = phase(model, args, "vtc", capacity, flood=False)
    res = {p: phase(model, args, p, capacity, flood=True) for p in ("vtc", "fifo")}
    a99 = alone["light_ttft_ms"]["p99"]
    out = {f"light_ttft_p99_ratio_{'fair' if p == 'vtc' else p}":
           round(r["light_ttft_ms"]["p99"] / a99, 3) if a99 and r["light_ttft_ms"]["p99"] else None
           for p, r in res.items()}
    fifo_tps = res["fifo"]["tokens_per_s"]
    out["throughput_ratio_vs_fifo"] = round(res["vtc"]["tokens_per_s"] / fifo_tps, 3) if fifo_tps else None
    # the bound the engine allows a light tenant under a flood: its
    # solo p99 plus one flood step, at most 2 steps
    vtc = res["vtc"]
    out.update(light_ttft_p99_ms=vtc["light_ttft_ms"]["p99"], solo_ttft_p99_ms=a99,
               flood_step_ms_p99=vtc["step_ms_p99"], steps_waited_p99=vtc["steps_waited_p99"])
    if a99 and vtc["step_ms_p99"] and vtc["light_ttft_ms"]["p99"]:
        out["within_ttft_bound"] = vtc["light_ttft_ms"]["p99"] <= a99 + vtc["step_ms_p99"]
    w = weighted(model, args) if args.weights else {}
    out["weighted_service_ratio"] = w.get("weighted_service_ratio")
    met = {"within_ttft_bound": out.get("within_ttft_bound") is True,
           "steps_waited_p99": out["steps_waited_p99"] is not None and out["steps_waited_p99"] <= 2,
           "throughput_ratio_vs_fifo": (out["throughput_ratio_vs_fifo"] or 0.0) >= 0.95}
    if args.weights:
        met["weighted_service_ratio"] = 1.8 <= (out["weighted_service_ratio"] or 0.0) <= 2.2
    out["met"] = met
    return {**out, "capacity_rps": round(capacity, 3), "alone": alone, "flood": res, "weights": w,
            "model": args.model, "dtype": str(model.dtype).removeprefix("torch."), "threads": args.threads,
            "cpu": cpu_model(), "duration_s": args.duration, "max_num_seqs": args.max_num_seqs,
            "max_batched_tokens": args.max_batched_tokens, "fair_step_tokens": args.fair_step_tokens,
            **machine_fields(load_before)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = ap.add_argument
    a("--json", action="store_true", help="print only the JSON line")
    add_no_targets(ap)
    a("--model", default="default", help="model spec ('default', 'tiny-random', path)")
    a("--dtype", default=None)
    a("--threads", type=int, default=2)
    a("--duration", type=float, default=30.0, help="seconds of arrivals per phase")
    a("--calibrate-s", type=float, default=10.0)
    a("--weights-s", type=float, default=20.0)
    a("--heavy-load", type=float, default=4.0)
    a("--light-load", type=float, default=0.1)
    a("--heavy-tokens", type=int, default=270, help="heavy prompts, in tokens")
    a("--light-tokens", type=int, default=60, help="light prompts, in tokens")
    a("--max-tokens", type=int, default=32)
    a("--max-num-seqs", type=int, default=16)
    a("--max-batched-tokens", type=int, default=512)
    a("--fair-step-tokens", type=int, default=0,
      help="the worker's shared-step prefill cap under VTC (0: none)")
    a("--weights", action=argparse.BooleanOptionalAction, default=True)
    a("--max-wait-s", type=float, default=120.0,
      help="after the arrivals, stop this long later; "
      "light requests still waiting count with their wait so far")
    a("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    result = bench(args)
    return emit(result, args.json, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
