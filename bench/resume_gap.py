"""Resume gap: how long a stream pauses when its worker is SIGKILLed and another carries it on.

Two workers with the default model, one gateway, N greedy streams; once every stream has `--after` tokens, one
worker is killed. The gap of a stream is its longest pause between two chunks after the kill; the streams that
moved are the ones with the largest gaps (as many as the gateway counted resumes). Prints one JSON line and
exits 1 when a target is missed: gap p50 <= 1 s, every stream whole (its full `max_tokens`).
Run: `python -m bench.resume_gap [--streams 8]` (needs redis-server; starts its own stack).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.machine import add_no_targets, cpu_model, exit_code
from config.loadtest.report import latency_stats_ms
from config.local_stack.launcher import Stack, StackConfig, WorkerProc, free_port

TARGET_P50_S = 1.0


def prompt(i: int, length: int) -> list[int]:
    return [500 + (131 * i + 7 * j) % 30_000 for j in range(length)]


async def one_stream(http: httpx.AsyncClient, base: str, key: str, body: dict, arrivals: list[float]) -> dict:
    """Stream one completion, noting when each chunk arrived; returns its finish reason, usage and error."""
    finish, usage, error = None, None, None
    async with http.stream("POST", base + "/v1/completions", json=body,
                           headers={"authorization": f"Bearer {key}"}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            error = event.get("error", error)
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                arrivals.append(time.monotonic())
                finish = choice.get("finish_reason") or finish
    return {"finish": finish, "usage": usage, "error": error}


async def run_streams(base: str, key: str, args: argparse.Namespace, victim: subprocess.Popen | None) -> dict:
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    async with httpx.AsyncClient(timeout=300) as http:
        tasks = [asyncio.create_task(one_stream(http, base, key, {
            "model": "default", "prompt": prompt(i, args.prompt_len), "max_tokens": args.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        }, arrivals[i])) for i in range(args.streams)]
        killed_at = None
        if victim is not None:
            async with asyncio.timeout(300):
                while min(len(a) for a in arrivals) < args.after:
                    await asyncio.sleep(0.005)
            victim.kill()
            killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 600)
    gaps = [max((b - a for a, b in zip(arr, arr[1:], strict=False) if b > killed_at), default=0.0)
            if killed_at else 0.0 for arr in arrivals]
    itl = [b - a for arr in arrivals for a, b in zip(arr, arr[1:], strict=False)]
    return {"results": results, "gaps": gaps, "itl": itl}


def resumes(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r'^switchyard_router_resumes_total\{[^}]*\} (\S+)$', text, re.M))


def workers_heard(base: str) -> int:
    """Workers the gateway has had stats from (each gets a hit-rate series)."""
    return len(re.findall(r'^switchyard_router_prefix_hit_rate\{',
                          httpx.get(base + "/metrics", timeout=10).text, re.M))


def run(args: argparse.Namespace) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="sy-resume-"))
    second = WorkerProc(log_dir, model="default", threads=1, extra=["--kv-cache-bytes", str(512 << 20)])
    stack = Stack(StackConfig(port=free_port(), log_dir=log_dir, worker_args=["--num-threads", "1"]))
    stack.config.gateway_args = ["--worker-timeout", str(args.worker_timeout),
                                 "--workers", f"{stack.worker_endpoint},{second.endpoint}"]
    try:
        stack.start()
        key = stack.create_tenant("resume-gap", max_concurrent=1000)
        deadline = time.monotonic() + 180
        while workers_heard(stack.base_url) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the second worker did not join")
            time.sleep(0.5)
        asyncio.run(run_streams(stack.base_url, key, args, None))  # warm-up: both workers have run
        before = resumes(stack.base_url)
        out = asyncio.run(run_streams(stack.base_url, key, args, stack.procs["worker"]))
        moved = int(resumes(stack.base_url) - before)
    finally:
        second.stop()
        stack.stop()
    whole = sum(r["error"] is None and r["finish"] == "length"
                and r["usage"]["completion_tokens"] == args.max_tokens
                for r in out["results"])
    gaps = sorted(out["gaps"], reverse=True)[:moved]
    stats = latency_stats_ms(gaps)
    return {"bench": "resume_gap", "cpu": cpu_model(), "model": "default", "streams": args.streams,
            "killed_after_tokens": args.after, "worker_timeout_s": args.worker_timeout, "resumed": moved,
            "whole": whole, "gap_p50_ms": stats["p50"],
            "gap_max_ms": round(1000 * max(gaps), 3) if gaps else None,
            "itl_p50_ms": latency_stats_ms(out["itl"])["p50"], "target_gap_p50_ms": 1000 * TARGET_P50_S,
            "within_target": stats["p50"] is not None and stats["p50"] <= 1000 * TARGET_P50_S,
            "met": {"gap_p50": stats["p50"] is not None and stats["p50"] <= 1000 * TARGET_P50_S,
                    "whole": whole == args.streams}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--after", type=int, default=20, help="tokens every stream has before the kill")
    ap.add_argument("--worker-timeout", type=float, default=1.0,
                    help="the gateway's silence limit (its default)")
    ap.add_argument("--json", action="store_true", help="(the output is always one JSON line)")
    add_no_targets(ap)
    args = ap.parse_args(argv)
    out = run(args)
    print(json.dumps(out))
    return exit_code(out, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
