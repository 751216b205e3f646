"""Benchmark: what the ZeroMQ hop (worker process + router client) costs against the bare engine.

Same workload as `bench.engine_throughput`, in-process and through a worker (`--json` for one line);
`--http` adds the full stack (gateway + worker, streaming `/v1/completions` with token-id prompts).
Targets: `ratio_vs_engine` >= 0.95, `http_ratio_vs_engine` >= 0.85; exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.machine import add_no_targets, cpu_model, exit_code

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"ratio_vs_engine": 0.95, "http_ratio_vs_engine": 0.85}  # at least


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_in_process(args: argparse.Namespace) -> tuple[list[tuple[list[int], int]], float]:
    """(workload, wall seconds) of the workload on an in-process engine."""
    import torch

    from bench.engine_throughput import workload as make_workload  # the engine benchmark owns the workload
    from worker.config import EngineConfig
    from worker.engine.core import Engine
    from worker.model.loader import load_any
    from worker.protocol import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_any(args.model, dtype=args.dtype)
    engine = Engine(loaded, EngineConfig(dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes))
    workload = make_workload(args.requests, args.seed, loaded.config.vocab_size)
    engine.generate([workload[0][0][:32]], SamplingParams(max_tokens=4))  # warm-up, as the engine bench does
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(workload):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
    produced = 0
    while engine.has_work():
        produced += sum(len(out.new_tokens) for out in engine.step())
    wall = time.perf_counter() - start
    if produced != sum(n for _, n in workload):
        raise RuntimeError("the engine produced the wrong number of tokens")
    del engine, loaded
    return workload, wall


async def _through_worker(endpoint: str, workload: list[tuple[list[int], int]],
                          ready_timeout: float) -> tuple[float, list[float]]:
    """(wall seconds, per-token hop latencies in seconds)."""
    from router.links.client import WorkerClient
    from worker.protocol import SamplingParams

    client = WorkerClient(endpoint, gateway_id=f"bench-{os.getpid()}", inter_token_timeout=120.0,
                          worker_timeout=10.0)
    await client.start()
    try:
        await client.wait_ready(ready_timeout)
        async for _ in client.generate("warm-up", b"bench", workload[0][0][:32],
                                       SamplingParams(max_tokens=4)):
            pass
        hops: list[float] = []
        start = time.perf_counter()

        async def one(i: int, prompt: list[int], out_len: int) -> int:
            n = 0
            async for chunk in client.generate(f"r{i}", b"bench", prompt,
                                               SamplingParams(max_tokens=out_len, ignore_eos=True)):
                hops.extend([time.time() - chunk.sent_at] * len(chunk.tokens))
                n += len(chunk.tokens)
            return n

        counts = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(workload)))
        wall = time.perf_counter() - start
        if counts != [n for _, n in workload]:
            raise RuntimeError("the worker produced the wrong number of tokens")
        return wall, hops
    finally:
        await client.close()


def run_through_worker(args: argparse.Namespace,
                       workload: list[tuple[list[int], int]]) -> tuple[float, list[float]]:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "config.cli", "worker", "--model", args.model, "--bind", endpoint,
           "--num-threads", str(args.threads), "--log-level", "WARNING", "--dtype", args.dtype,
           "--kv-cache-bytes", str(args.kv_cache_bytes)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        return asyncio.run(_through_worker(endpoint, workload, args.ready_timeout))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def _through_http(base_url: str, key: str, workload: list[tuple[list[int], int]]) -> float:
    """Wall seconds of the workload as streaming completions through the gateway, all requests at once."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"}

    async def one(client: httpx.AsyncClient, prompt: list[int], out_len: int) -> int:
        body = {"model": "default", "prompt": prompt, "max_tokens": out_len, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        n = 0
        async with client.stream("POST", base_url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"gateway answered {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line:
                    n = json.loads(line[6:])["usage"]["completion_tokens"]
        return n

    limits = httpx.Limits(max_connections=len(workload) + 4)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        await one(client, workload[0][0][:32], 4)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p, n) for p, n in workload))
        wall = time.perf_counter() - start
    if counts != [n for _, n in workload]:
        raise RuntimeError("the stack produced the wrong number of tokens")
    return wall


def run_through_http(args: argparse.Namespace, workload: list[tuple[list[int], int]]) -> float:
    from config.local_stack.launcher import Stack, StackConfig, free_port

    wargs = ["--num-threads", str(args.threads), "--log-level", "WARNING", "--dtype", args.dtype,
             "--kv-cache-bytes", str(args.kv_cache_bytes)]
    stack = Stack(StackConfig(port=free_port(), model=args.model, worker_args=wargs,
                              gateway_args=["--log-level", "WARNING"], ready_timeout=args.ready_timeout,
                              log_dir=Path(os.environ.get("TMPDIR", "/tmp")) / f"zmq-overhead-{os.getpid()}"))
    stack.start()
    try:
        key = stack.create_tenant("bench", tpm=0, rpm=0, max_concurrent=0, max_tokens=4096)
        return asyncio.run(_through_http(stack.base_url, key, workload))
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                    help="engine dtype on both sides (auto: the worker's choice, as in the engine benchmark)")
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 30, help="as the engine benchmark")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--http", action="store_true", help="also through gateway + worker over HTTP (SSE)")
    add_no_targets(ap)
    args = ap.parse_args(argv)
    workload, eng_wall = run_in_process(args)
    out_tokens = sum(n for _, n in workload)
    zmq_wall, hops = run_through_worker(args, workload)
    extra = [h * 1000.0 for h in hops]
    result = {
        "requests": args.requests, "seed": args.seed, "model": args.model, "output_tokens": out_tokens,
        "engine_tok_s": round(out_tokens / eng_wall, 1), "zmq_tok_s": round(out_tokens / zmq_wall, 1),
        "ratio_vs_engine": round(eng_wall / zmq_wall, 3),
        "extra_latency_ms_p50": round(_percentile(extra, 0.5), 2),
        "extra_latency_ms_p99": round(_percentile(extra, 0.99), 2),
        "threads": args.threads, "dtype": args.dtype, "cpu": cpu_model(),
    }
    if args.http:
        http_wall = run_through_http(args, workload)
        result["http_tok_s"] = round(out_tokens / http_wall, 1)
        result["http_ratio_vs_engine"] = round(eng_wall / http_wall, 3)
    result["targets"] = {k: v for k, v in TARGETS.items() if k in result}
    result["met"] = {k: result[k] >= v for k, v in result["targets"].items()}
    if not args.json:
        print(f"in-process {eng_wall:.2f}s, through the worker {zmq_wall:.2f}s", file=sys.stderr)
    print(json.dumps(result))
    return exit_code(result, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
