"""Benchmark: one gateway over a Switchyard worker and a vLLM-engine worker, then the vLLM-engine worker
behind the gateway against vLLM's own OpenAI server on the same engine settings, in one run.

Part 1 (fleet): `bench/routing.py`'s prefix workload (shared system prompts, random-id suffixes) for 4 tenants
that all send the same system prompts, streamed through the gateway. `hit_ratio_vs_oracle`: cached prompt
tokens / the most any placement could cache (every request after its tenant's first with that system prompt:
the whole block-aligned system prompt); `cross_tenant_hits`: a tenant's first request for a system prompt that
found anything cached (the other tenants sent the same tokens). The gateway indexes the vLLM-engine worker's
blocks from vLLM's own KV events (`kv_event_feeds`, hashes `vllm`, salted per tenant).
Part 2 (overhead): sequential streams (a 256-token prompt, 64 tokens out) to the vLLM-engine worker through a
gateway, then to `vllm serve` with the same engine flags; TTFT and TPOT p50 of each and their ratios.

Targets (`met`): 0 errors, hit_ratio_vs_oracle >= 0.9, cross_tenant_hits == 0, TTFT and TPOT p50 behind
Switchyard within 10% of vLLM's own server. Run it from `.venv-vllm` (`make install-vllm`):
`.venv-vllm/bin/python -m bench.engines --json`. Prints one JSON line; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.engine_fleet import EngineFleet, vllm_serve
from bench.machine import add_no_targets, cpu_model, emit
from bench.routing import build_workload
from config.local_stack.launcher import free_port

TENANTS = 4
# vLLM's threads on core 1 in both parts (the Switchyard worker and the gateway share core 0 in part 1)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}


async def stream_one(http, base: str, key: str, prompt: list[int], max_tokens: int) -> dict:  # noqa: ANN001
    """One streamed completion: TTFT, TPOT, cached tokens, error."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks, usage, error = 0, None, None
    async with http.stream("POST", base + "/v1/completions", json=body,
                           headers={"authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            return {"error": f"http {resp.status_code}: {(await resp.aread())[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = str(event["error"])[:200]
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices", [])):
                now = time.perf_counter()
                first = first if first is not None else now
                last, chunks = now, chunks + 1
    if error or usage is None or first is None:
        return {"error": error or "no usage or no token"}
    out = usage["completion_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": first - t0, "tpot": (last - first) / max(1, out - 1), "cached": int(cached),
            "error": None}


async def fleet_workload(base: str, keys: list[str], args: argparse.Namespace) -> dict:
    import httpx

    work = build_workload(args.seed, args.prompts, args.prompt_len, args.per_prompt)
    jobs = [(t, p, tokens) for p, tokens in work for t in range(len(keys))]  # each tenant sends the same
    seen: set[tuple[int, int]] = set()
    firsts = [(t, p) not in seen and not seen.add((t, p)) for t, p, _ in jobs]
    sem = asyncio.Semaphore(args.concurrency)

    async def one(t: int, tokens: list[int]) -> dict:
        async with sem:
            return await stream_one(http, base, keys[t], tokens, args.max_tokens)

    async with httpx.AsyncClient(timeout=600) as http:
        results = await asyncio.gather(*(one(t, tokens) for t, _, tokens in jobs))
    errors = [r["error"] for r in results if r["error"]]
    cacheable = args.prompt_len // args.block * args.block
    oracle = sum(cacheable for first in firsts if not first)
    cached = sum(r.get("cached", 0) for r in results)
    return {"requests": len(jobs), "errors": len(errors), "first_errors": errors[:3],
            "hit_ratio_vs_oracle": round(cached / oracle, 3) if oracle else None,
            "cross_tenant_hits": sum(1 for r, first in zip(results, firsts, strict=True)
                                     if first and r.get("cached", 0) > 0)}


async def sequential(base: str, key: str, args: argparse.Namespace, label: str) -> dict:
    import httpx

    prompts = [w for _, w in build_workload(args.seed + 1, args.single_n, 256, 1)]
    async with httpx.AsyncClient(timeout=600) as http:
        await stream_one(http, base, key, prompts[0][:32], 4)  # warm: the first request compiles
        results = [await stream_one(http, base, key, p, args.single_tokens) for p in prompts]
    ok = [r for r in results if not r["error"]]
    return {f"{label}_errors": len(results) - len(ok),
            f"{label}_ttft_p50_ms": round(statistics.median(r["ttft"] for r in ok) * 1000, 2) if ok else None,
            f"{label}_tpot_p50_ms": round(statistics.median(r["tpot"] for r in ok) * 1000, 3) if ok else None}


def hf_model(out: Path) -> Path:
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "worker.vllm_engine.hf_folder", "default", str(out)],
                       check=True, capture_output=True, timeout=600)
    return out


def run(args: argparse.Namespace) -> dict:
    os.environ.update({k: v for k, v in VLLM_ENV.items() if k not in os.environ})
    logs = Path(tempfile.mkdtemp(prefix="sy-bench-engines-"))
    model = hf_model(Path(args.model_dir))
    engine_args = f"--max-model-len 4096 --block-size {args.block}"
    out: dict = {"bench": "engines", "cpu": cpu_model(), "dtype": args.dtype, "block_size": args.block,
                 "engine_args": engine_args, "tenants": TENANTS, "prompt_len": args.prompt_len}
    with EngineFleet(logs, model, args.dtype, engine_args, args.block) as fleet:
        keys = [fleet.tenant(f"engines-{t}") for t in range(TENANTS)]
        out.update(asyncio.run(fleet_workload(fleet.base_url, keys, args)))
        out["kv_feed"] = fleet.feed_counts()
        fleet.stop_switchyard_worker()  # part 2: the gateway has only the vLLM-engine worker left
        out.update(asyncio.run(sequential(fleet.base_url, keys[0], args, "switchyard_vllm")))
    port = free_port()
    with vllm_serve(logs, model, args.dtype, engine_args, port):
        out.update(asyncio.run(sequential(f"http://127.0.0.1:{port}", "none", args, "vllm_server")))
    for what in ("ttft", "tpot"):
        ours, theirs = out[f"switchyard_vllm_{what}_p50_ms"], out[f"vllm_server_{what}_p50_ms"]
        out[f"{what}_ratio"] = round(ours / theirs, 3) if ours and theirs else None
    ours, theirs = out["switchyard_vllm_ttft_p50_ms"], out["vllm_server_ttft_p50_ms"]
    out["overhead_p50_ms"] = round(ours - theirs, 2) if ours and theirs else None
    out["met"] = {"errors": out["errors"] == 0 and out["switchyard_vllm_errors"] == 0,
                  "hit_ratio": (out["hit_ratio_vs_oracle"] or 0) >= 0.9,
                  "cross_tenant": out["cross_tenant_hits"] == 0,
                  "ttft_within_10pct": (out["ttft_ratio"] or 9) <= 1.10,
                  "tpot_within_10pct": (out["tpot_ratio"] or 9) <= 1.10}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "switchyard-smollm2-hf"),
                    help="the default model as an HF folder (made here when missing)")
    ap.add_argument("--dtype", default="bfloat16", help="both engines' dtype (float32 on AVX2-only CPUs)")
    ap.add_argument("--block", type=int, default=32,
                    help="KV block size of both engines and the router (vLLM on CPU: a multiple of 32)")
    ap.add_argument("--prompts", type=int, default=6, help="system prompts (each tenant sends all of them)")
    ap.add_argument("--prompt-len", type=int, default=512, help="system prompt tokens")
    ap.add_argument("--per-prompt", type=int, default=3, help="requests per system prompt and tenant")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--single-n", type=int, default=12, help="sequential requests of part 2 (each side)")
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=20261129)
    add_no_targets(ap)
    args = ap.parse_args(argv)
    return emit(run(args), args.json, enforce=not args.no_targets)


if __name__ == "__main__":
    sys.exit(main())
