"""TTFT deadline attainment under 2x overload: interactive Poisson load with deadlines, then without.

One worker (`--model`, default the default model; a small KV cache, so the gateway's capacity gate queues),
one gateway and a private Redis. First the unloaded TTFT p50 (requests one at a time) and the capacity
(completed requests per second of a closed loop at `--calib-conc` in flight); the target is `--slo-ms` (0: the
largest of 4x the unloaded TTFT p50, 2x the unloaded request's length and `--slo-floor-ms`). Then open-loop
Poisson at `--overload` x capacity for `--seconds`, twice on the same stack: tenant `on` (its `ttft_slo_ms`
and every request's `x-switchyard-ttft-slo-ms` are the target) and tenant `off` (no target; attainment is
computed against the same target). Streaming completions of seeded token prompts
(`--prompt-min`..`--prompt-max` tokens) and `--max-tokens` each. Per arm: admitted, shed (503
ttft_slo_unattainable; other 429/503), errors, `slo_attainment` (admitted requests whose client-measured TTFT
<= target / admitted), how late the latest admitted request was (`missed_late_max_ms`), `shed_frac`, TTFT
p50/p99 of admitted, and the gateway's `switchyard_ttft_slo_total` outcomes. Targets: attainment >= 0.95 with
deadlines, 0 errors in either arm; exits 1 when one is missed (`--no-targets`: 0).

    .venv/bin/python -m bench.batch_slo --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import tempfile
import time
from pathlib import Path

import httpx

from bench.machine import add_no_targets, cpu_model, emit, machine_fields
from config.loadtest.report import latency_stats_ms
from config.local_stack.launcher import Stack, StackConfig, free_port

TTFT_HEADER = "x-switchyard-ttft-slo-ms"
TARGET_ATTAINMENT = 0.95
UNLIMITED = {"tpm": 0, "rpm": 0, "max_concurrent": 0}


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """`n` seeded token prompts of lo..hi tokens (random ids: no two share a prefix)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 30_000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def one(http: httpx.AsyncClient, url: str, key: str, prompt: list[int], max_tokens: int,
              slo_ms: int | None) -> dict:
    """One streamed completion: its outcome (`ok`, `shed_slo`, `shed_other`, `error`) and client TTFT (s)."""
    headers = {"authorization": f"Bearer {key}", **({TTFT_HEADER: str(slo_ms)} if slo_ms else {})}
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                code = _error_code(text)
                if resp.status_code == 503 and code == "ttft_slo_unattainable":
                    return {"outcome": "shed_slo"}
                if resp.status_code in (429, 503):
                    return {"outcome": "shed_other", "code": code or str(resp.status_code)}
                return {"outcome": "error", "error": f"{resp.status_code} {text[:200]}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("error"):
                    return {"outcome": "error", "error": str(event["error"])[:200], "ttft": ttft}
                if any(c.get("text") for c in event.get("choices", [])):
                    tokens += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        return {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}
    if ttft is None:
        return {"outcome": "error", "error": "no token"}
    return {"outcome": "ok", "ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": tokens}


def _error_code(text: str) -> str | None:
    try:
        return json.loads(text)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def unloaded(url: str, key: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """TTFTs and whole-request times of requests sent one at a time (the first few are warm-up, not
    counted)."""
    ttft, e2e = [], []
    async with httpx.AsyncClient(timeout=args.timeout) as http:
        for i, p in enumerate(prompts(args.warmup + args.unloaded_n, args.prompt_min, args.prompt_max,
                                      args.seed + 100)):
            r = await one(http, url, key, p, args.max_tokens, None)
            if r["outcome"] != "ok":
                raise SystemExit(f"unloaded request failed: {r}")
            if i >= args.warmup:
                ttft.append(r["ttft"])
                e2e.append(r["e2e"])
    return ttft, e2e


async def capacity(url: str, key: str, args: argparse.Namespace) -> float:
    """Completed requests per second of a closed loop with `calib_conc` in flight."""
    pool = prompts(4096, args.prompt_min, args.prompt_max, args.seed + 200)
    done, t0 = 0, time.perf_counter()
    until = t0 + args.calib_s
    limits = httpx.Limits(max_connections=args.calib_conc + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        async def lane(j: int) -> None:
            nonlocal done
            i = j
            while time.perf_counter() < until:
                r = await one(http, url, key, pool[i % len(pool)], args.max_tokens, None)
                done += r["outcome"] == "ok"
                i += args.calib_conc

        await asyncio.gather(*(lane(j) for j in range(args.calib_conc)))
    return done / (time.perf_counter() - t0)


async def open_loop(url: str, key: str, args: argparse.Namespace, rate: float, slo_ms: int | None,
                    seed: int) -> tuple[list[dict], float]:
    """Poisson arrivals at `rate` for `seconds`; every request's record, and the wall time to the last."""
    rng = random.Random(seed)
    offsets, t = [], rng.expovariate(rate)
    while t < args.seconds:
        offsets.append(t)
        t += rng.expovariate(rate)
    reqs = prompts(len(offsets), args.prompt_min, args.prompt_max, seed)
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        t0 = time.perf_counter()

        async def at(offset: float, prompt: list[int]) -> dict:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await one(http, url, key, prompt, args.max_tokens, slo_ms)

        records = await asyncio.gather(*(at(o, p) for o, p in zip(offsets, reqs, strict=True)))
        return list(records), time.perf_counter() - t0


def arm_summary(records: list[dict], slo_ms: float, wall: float) -> dict:
    admitted = [r for r in records if r["outcome"] == "ok"]
    ttft = [r["ttft"] for r in admitted]
    shed_slo = sum(r["outcome"] == "shed_slo" for r in records)
    shed_other = [r for r in records if r["outcome"] == "shed_other"]
    errors = [r["error"] for r in records if r["outcome"] == "error"]
    within = sum(t * 1e3 <= slo_ms for t in ttft)
    stats = latency_stats_ms(ttft)
    other_codes: dict[str, int] = {}
    for r in shed_other:
        other_codes[r["code"]] = other_codes.get(r["code"], 0) + 1
    return {"requests": len(records), "admitted": len(admitted), "shed_slo": shed_slo,
            "shed_other": len(shed_other), "shed_other_codes": other_codes, "errors": len(errors),
            "error_samples": errors[:3],
            "slo_attainment": round(within / len(admitted), 4) if admitted else None,
            "missed_admitted": len(admitted) - within,
            "missed_late_max_ms": round(max((t * 1e3 - slo_ms for t in ttft), default=0.0), 1)
            if within < len(admitted) else 0.0,
            "shed_frac": round((shed_slo + len(shed_other)) / len(records), 4) if records else None,
            "ttft_p50_ms": stats["p50"], "ttft_p99_ms": stats["p99"],
            "admitted_per_s": round(len(admitted) / wall, 3) if wall else None, "wall_s": round(wall, 2)}


def slo_counts(url: str, tenant: str) -> dict[str, float]:
    """The gateway's `switchyard_ttft_slo_total` outcomes of `tenant` (all priorities)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for labels, value in re.findall(r'^switchyard_ttft_slo_total\{([^}]*)\} (\S+)$', text, re.M):
        m = re.search(r'outcome="([^"]+)"', labels)
        if m and f'tenant="{tenant}"' in labels:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(value)
    return out


def kv_bytes(args: argparse.Namespace) -> int:
    from bench.routing import kv_bytes_per_token

    return args.kv_tokens * kv_bytes_per_token(args.model, None)


def start_stack(args: argparse.Namespace, log_dir: Path) -> Stack:
    config = log_dir / "gateway.toml"
    config.write_text("[gateway]\n"
                      f"admission_wait_ms = {args.admission_wait_ms}\n"
                      'metrics_tenant_labels = ["on", "off"]\n'
                      "ttft_slo_ms = {interactive = 0, batch = 0}\n")
    wargs = ["--model", args.model, "--no-prefix-cache", "--num-threads", str(args.threads),
             "--max-num-seqs", str(args.max_num_seqs),
             *(["--kv-cache-bytes", str(kv_bytes(args))] if args.kv_tokens else [])]
    stack = Stack(StackConfig(port=free_port(), log_dir=log_dir, worker_args=wargs,
                              gateway_args=["--config", str(config), "--log-level", "WARNING"]))
    stack.start()
    return stack


def run(args: argparse.Namespace) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="sy-batch-slo-"))
    load_before = os.getloadavg()
    stack = start_stack(args, log_dir)
    try:
        url = stack.base_url
        calib = stack.create_tenant("calib", **UNLIMITED)
        ttft_s, e2e_s = asyncio.run(unloaded(url, calib, args))
        alone, alone_e2e = latency_stats_ms(ttft_s), latency_stats_ms(e2e_s)
        # at capacity KV is full, so an admitted request waits for a running one to end: a target under a
        # request's length is mostly shed; the default is 4x the unloaded TTFT and 2x the request length
        slo_ms = args.slo_ms or round(max(args.slo_floor_ms, 4 * (alone["p50"] or 0),
                                          2 * (alone_e2e["p50"] or 0)))
        cap = asyncio.run(capacity(url, calib, args))
        rate = args.overload * cap
        arms = {}
        for i, (name, deadlines) in enumerate((("deadlines", True), ("no_deadlines", False))):
            tenant = "on" if deadlines else "off"
            key = stack.create_tenant(tenant, ttft_slo_ms=slo_ms if deadlines else 0, **UNLIMITED)
            records, wall = asyncio.run(open_loop(url, key, args, rate, slo_ms if deadlines else None,
                                                  args.seed + 1000 * (i + 1)))
            arms[name] = {**arm_summary(records, slo_ms, wall), "gateway_slo_counts": slo_counts(url, tenant)}
    finally:
        stack.stop()
    on, off = arms["deadlines"], arms["no_deadlines"]
    met = {"slo_attainment": on["slo_attainment"] is not None and on["slo_attainment"] >= TARGET_ATTAINMENT,
           "errors": on["errors"] == 0 and off["errors"] == 0}
    return {"bench": "batch_slo", "part": "deadlines", "cpu": cpu_model(), **machine_fields(load_before),
            "model": args.model, "max_num_seqs": args.max_num_seqs, "kv_tokens": args.kv_tokens,
            "prompt_tokens": [args.prompt_min, args.prompt_max], "max_tokens": args.max_tokens,
            "admission_wait_ms": args.admission_wait_ms, "unloaded_ttft_ms": alone,
            "unloaded_request_ms": alone_e2e["p50"],
            "capacity_rps": round(cap, 3), "overload": args.overload, "rate_rps": round(rate, 3),
            "seconds": args.seconds, "slo_ms": slo_ms,
            "slo_attainment": on["slo_attainment"], "shed_frac": on["shed_frac"],
            "slo_attainment_no_deadlines": off["slo_attainment"], "shed_frac_no_deadlines": off["shed_frac"],
            "arms": arms, "target_slo_attainment": TARGET_ATTAINMENT, "met": met}


def add_load_arguments(ap: argparse.ArgumentParser, calib_s: float) -> None:
    """The request shape, worker, capacity run and output flags this bench shares with bench/batch_fill.py."""
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calib-conc", type=int, default=16, help="closed-loop concurrency of the capacity run")
    ap.add_argument("--calib-s", type=float, default=calib_s)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    add_no_targets(ap)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each open-loop arm")
    ap.add_argument("--overload", type=float, default=2.0, help="arrival rate as a multiple of capacity")
    ap.add_argument("--slo-ms", type=int, default=0,
                    help="TTFT target (0: the largest of 4x the unloaded TTFT p50, 2x the unloaded request)")
    ap.add_argument("--slo-floor-ms", type=int, default=100, help="least automatic target")
    ap.add_argument("--kv-tokens", type=int, default=768,
                    help="worker KV cache in tokens, small so the gateway queues (0: the worker's default)")
    ap.add_argument("--admission-wait-ms", type=int, default=30_000,
                    help="the gateway's capacity-queue wait (long: without deadlines requests wait)")
    ap.add_argument("--unloaded-n", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    add_load_arguments(ap, calib_s=5.0)
    args = ap.parse_args(argv)
    return emit(run(args), args.json, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
