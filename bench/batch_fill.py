"""Batch work in idle capacity: interactive TTFT with and without a batch running, and how much of the spare
capacity the batch fills (issue 56, bench part (a)).

One worker (`--model`, default the default model), one gateway with the Files and Batch APIs
(`batch_concurrency` lines in flight), a private Redis. First a closed loop of `--calib-conc` interactive
requests sets the interactive rate: open-loop Poisson at `--load` x its completed requests per second, for
`--seconds`, alone. Then a `--lines`-line batch of requests of the same shape is submitted through `/v1/files`
and `/v1/batches`; once its first line is answered it runs alone for `--batch-alone-s` (the engine's capacity
in output tokens per second: the larger of this and the closed loop's), then beside the same interactive
load. The batch's output tokens come from its request counts (every line and request ignores EOS, so each
makes exactly `--max-tokens`). `interactive_ttft_p99_ratio` = TTFT p99 with the batch / alone;
`batch_idle_fill` = batch output tokens per second / (capacity - the interactive output tokens per second).
`--pin` (two CPUs or more) runs the worker alone on one and everything else on another.
Targets: ratio <= 1.1 and fill >= 0.8; exits 1 on a miss (`--no-targets`: 0). The batch is cancelled at the
end.

    .venv/bin/python -m bench.batch_fill --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from bench.batch_slo import UNLIMITED, add_load_arguments, capacity, open_loop, prompts
from bench.machine import cpu_model, emit, machine_fields
from config.loadtest.report import latency_stats_ms
from config.local_stack.launcher import Stack, StackConfig, free_port

TARGETS = {"interactive_ttft_p99_ratio": 1.1, "batch_idle_fill": 0.8}


def start_stack(args: argparse.Namespace, log_dir: Path) -> Stack:
    files = log_dir / "files"
    files.mkdir()
    config = log_dir / "gateway.toml"
    config.write_text(f'[gateway]\nfiles_dir = "{files}"\nbatch_concurrency = {args.batch_concurrency}\n')
    wargs = ["--model", args.model, "--num-threads", str(args.threads),
             "--max-num-seqs", str(args.max_num_seqs)]
    stack = Stack(StackConfig(port=free_port(), log_dir=log_dir, worker_args=wargs,
                              gateway_args=["--config", str(config), "--log-level", "WARNING"]))
    stack.start()
    return stack


def pin(stack: Stack) -> dict[str, int] | None:
    """The worker alone on the first CPU, the gateway, Redis and this load generator on the second (every
    thread of each process), so that the clients' cost is not taken from the engine; None on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    where = {"worker": cpus[0], "gateway": cpus[1], "redis": cpus[1]}
    for name, cpu in where.items():
        proc = stack.procs.get(name)
        if proc is None:
            continue
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            os.sched_setaffinity(int(tid), {cpu})
    os.sched_setaffinity(0, {cpus[1]})
    return where


def submit_batch(http: httpx.Client, key: str, args: argparse.Namespace) -> str:
    """Upload `--lines` completion requests and start their batch; its id."""
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "default", "prompt": p, "max_tokens": args.max_tokens, "ignore_eos": True,
                       "temperature": 0}}
             for i, p in enumerate(prompts(args.lines, args.prompt_min, args.prompt_max, args.seed + 500))]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    auth = {"authorization": f"Bearer {key}"}
    up = http.post("/v1/files", headers=auth, files={"file": ("lines.jsonl", data)},
                   data={"purpose": "batch"})
    up.raise_for_status()
    made = http.post("/v1/batches", headers=auth, json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    made.raise_for_status()
    return made.json()["id"]


def batch_counts(http: httpx.Client, key: str, batch_id: str) -> dict:
    got = http.get(f"/v1/batches/{batch_id}", headers={"authorization": f"Bearer {key}"})
    got.raise_for_status()
    return got.json()["request_counts"]


def wait_first_line(http: httpx.Client, key: str, batch_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while batch_counts(http, key, batch_id)["completed"] == 0:
        if time.monotonic() > deadline:
            raise SystemExit("the batch answered no line in time")
        time.sleep(0.2)


def interactive(url: str, key: str, args: argparse.Namespace, rate: float, seed: int) -> dict:
    """One open-loop arm: TTFT figures and output tokens per second of the requests that completed."""
    records, wall = asyncio.run(open_loop(url, key, args, rate, None, seed))
    ok = [r for r in records if r["outcome"] == "ok"]
    return {"requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
            "ttft_ms": latency_stats_ms([r["ttft"] for r in ok]),
            "out_tok_s": round(len(ok) * args.max_tokens / wall, 2), "wall_s": round(wall, 2)}


def run(args: argparse.Namespace) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="sy-batch-fill-"))
    load_before = os.getloadavg()
    stack = start_stack(args, log_dir)
    try:
        url = stack.base_url
        pinned = pin(stack) if args.pin else None
        key = stack.create_tenant("inter", **UNLIMITED)
        batch_key = stack.create_tenant("offline", **UNLIMITED)
        cap_rps = asyncio.run(capacity(url, key, args))
        cap_tok_s = cap_rps * args.max_tokens
        rate = args.load * cap_rps
        alone = interactive(url, key, args, rate, args.seed + 1000)
        with httpx.Client(base_url=url, timeout=60) as http:
            batch_id = submit_batch(http, batch_key, args)
            wait_first_line(http, batch_key, batch_id, args.timeout)
            first, t0 = batch_counts(http, batch_key, batch_id), time.perf_counter()
            time.sleep(args.batch_alone_s)
            before, t1 = batch_counts(http, batch_key, batch_id), time.perf_counter()
            alone_tok_s = (before["completed"] - first["completed"]) * args.max_tokens / (t1 - t0)
            t0 = time.perf_counter()
            beside = interactive(url, key, args, rate, args.seed + 1000)  # the same arrivals and prompts
            after, window = batch_counts(http, batch_key, batch_id), time.perf_counter() - t0
            http.post(f"/v1/batches/{batch_id}/cancel", headers={"authorization": f"Bearer {batch_key}"})
    finally:
        stack.stop()
    batch_tok_s = (after["completed"] - before["completed"]) * args.max_tokens / window
    cap_tok_s = max(cap_tok_s, alone_tok_s)
    spare = max(cap_tok_s - beside["out_tok_s"], 1e-9)
    p99_alone, p99_beside = alone["ttft_ms"]["p99"], beside["ttft_ms"]["p99"]
    ratio = round(p99_beside / p99_alone, 3) if p99_alone and p99_beside else None
    fill = round(batch_tok_s / spare, 3)
    met = {"interactive_ttft_p99_ratio": ratio is not None and ratio <= TARGETS["interactive_ttft_p99_ratio"],
           "batch_idle_fill": fill >= TARGETS["batch_idle_fill"],
           "errors": alone["errors"] == 0 and beside["errors"] == 0}
    return {"bench": "batch_fill", "cpu": cpu_model(), **machine_fields(load_before),
            "model": args.model, "max_num_seqs": args.max_num_seqs,
            "batch_concurrency": args.batch_concurrency, "batch_alone_out_tok_s": round(alone_tok_s, 2),
            "pinned": pinned,
            "prompt_tokens": [args.prompt_min, args.prompt_max], "max_tokens": args.max_tokens,
            "capacity_out_tok_s": round(cap_tok_s, 2), "load": args.load, "rate_rps": round(rate, 3),
            "lines": args.lines, "batch_lines_in_window": after["completed"] - before["completed"],
            "batch_out_tok_s": round(batch_tok_s, 2), "interactive_ttft_p99_ratio": ratio,
            "batch_idle_fill": fill, "alone": alone, "with_batch": beside, "targets": TARGETS, "met": met}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each interactive arm")
    ap.add_argument("--load", type=float, default=0.5, help="interactive arrival rate as a part of capacity")
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--batch-alone-s", type=float, default=10.0, help="the batch alone: engine capacity")
    ap.add_argument("--batch-concurrency", type=int, default=16, help="batch lines the gateway runs at once")
    ap.add_argument("--pin", action="store_true",
                    help="the worker on a CPU of its own; the gateway, Redis and the load on another")
    add_load_arguments(ap, calib_s=10.0)
    args = ap.parse_args(argv)
    return emit(run(args), args.json, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
