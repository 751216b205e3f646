"""KV tiers benchmark: T tenants, each with its own ~1,000-token system prompt, a working set of at least 4x the KV
pool, requests in random tenant order; tiers off vs on (host RAM at its auto size) in one process.

Targets on CPU: `ttft_p50_ratio` (on / off) <= 0.35, `cached_frac_on` >= 0.8 (--json for one line).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from bench.machine import cpu_model, emit, machine_fields
from bench.prefix_cache import CITIES, TOPICS, system_prompt
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.kvcache.kv_dtype import resolve_kv_dtype
from worker.kvcache.tensors import bytes_per_page
from worker.model.loader import LoadedModel, load_model
from worker.protocol import SamplingParams

TARGETS = {"ttft_p50_ratio": 0.35, "cached_frac_on": 0.8}
COMPANIES = ("Northwind", "Contoso", "Fabrikam", "Tailspin", "Wingtip", "Litware", "Adatum", "Proseware",
             "Lucerne", "Margie's", "Woodgrove", "Alpine", "Coho", "Fourth Coffee", "Humongous", "Trey")


def tenant_prompts(loaded: LoadedModel, tenants: int, system_tokens: int) -> list[list[int]]:
    """One system prompt per tenant (its own company and rule order), as chat-template token ids."""
    tok = loaded.tokenizer
    base = system_prompt(tok, system_tokens)
    out = []
    for t in range(tenants):
        rules = base.split(". ")
        random.Random(t).shuffle(rules)
        out.append(f"You work for {COMPANIES[t % len(COMPANIES)]} (desk {t}). " + ". ".join(rules))
    return [tok.apply_chat_template([{"role": "system", "content": s}]) for s in out]


def question(tok, i: int) -> list[int]:
    text = f"Hi, order {1000 + i} to {CITIES[i % len(CITIES)]}: what about {TOPICS[(i * 7) % len(TOPICS)]}?"
    return tok.encode(text, add_special_tokens=False)


def run(loaded: LoadedModel, systems: list[list[int]], order: list[int], args: argparse.Namespace, tiers: bool,
        pages: int, kv_dtype: str) -> dict:
    """Warm each tenant once (untimed), then the timed requests one at a time: TTFT, cached share, tier stats."""
    per_page = bytes_per_page(loaded.config, loaded.dtype, args.block_size, kv_dtype)
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=pages * per_page, kv_dtype=kv_dtype,
                                         block_size=args.block_size, kv_host_bytes=None if tiers else 0))
    tok = loaded.tokenizer
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)

    def one(rid: str, tenant: int, i: int) -> tuple[float, int, int]:
        prompt = systems[tenant] + question(tok, i)
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, params, namespace=b"tenant-%d" % tenant)
        ttft, cached = None, 0
        while engine.has_work():
            for out in engine.step():
                if ttft is None and out.new_tokens:
                    ttft, cached = time.perf_counter() - t0, out.cached_tokens
        assert ttft is not None
        return ttft, cached, len(prompt)

    for t in range(len(systems)):
        one(f"warm{t}", t, 10_000 + t)
    ttfts, cached, prompt = [], 0, 0
    for i, t in enumerate(order):
        s, c, n = one(f"q{i}", t, i)
        ttfts.append(s)
        cached += c
        prompt += n
    st = engine.stats()
    engine.close()
    ts = st.tiers
    return {"ttft": ttfts, "cached_frac": cached / prompt, "pool_tokens": st.kv_total_tokens,
            "restored_tokens": ts.restored_tokens if ts else 0, "host_mb": round(ts.ram_bytes / 2**20, 1) if ts else 0,
            "skipped_by_cost": ts.skipped_by_cost if ts else 0,
            "restore_ms_per_1k": round(1e6 * ts.load_seconds / ts.restored_tokens, 2) if ts and ts.restored_tokens
            else None}


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[-1] if len(xs) > 1 else xs[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=4)
    ap.add_argument("--pool-factor", type=float, default=5.0, help="working set / KV pool (>= 4)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="auto", help="auto | model | int8")
    ap.add_argument("--dtype", default="auto", help="auto (the worker's choice) | bfloat16 | float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    loaded = load_model("default", dtype=args.dtype, device="cpu")
    kv_dtype = resolve_kv_dtype(EngineConfig(kv_dtype=args.kv_dtype), loaded.device)[0]
    systems = tenant_prompts(loaded, args.tenants, args.system_tokens)
    working_set = sum(len(s) for s in systems)
    pages = int(working_set / args.pool_factor) // args.block_size
    rng = random.Random(args.seed)
    order = [rng.randrange(args.tenants) for _ in range(args.requests)]
    res = {}
    for tiers in (False, True):
        res[tiers] = run(loaded, systems, order, args, tiers, pages, kv_dtype)
        print(f"tiers {'on' if tiers else 'off'}: ttft p50 {statistics.median(res[tiers]['ttft']) * 1e3:.1f} ms, "
              f"cached {res[tiers]['cached_frac']:.3f}", file=sys.stderr, flush=True)
    off, on = res[False], res[True]
    assert working_set >= 4 * on["pool_tokens"], "the working set must be at least 4x the KV pool"
    result = {
        "ttft_p50_ratio": round(statistics.median(on["ttft"]) / statistics.median(off["ttft"]), 4),
        "ttft_p99_ratio": round(p99(on["ttft"]) / p99(off["ttft"]), 4),
        "cached_frac_on": round(on["cached_frac"], 4), "cached_frac_off": round(off["cached_frac"], 4),
        "ttft_p50_on_ms": round(statistics.median(on["ttft"]) * 1e3, 1),
        "ttft_p50_off_ms": round(statistics.median(off["ttft"]) * 1e3, 1),
        "ttft_p99_on_ms": round(p99(on["ttft"]) * 1e3, 1), "ttft_p99_off_ms": round(p99(off["ttft"]) * 1e3, 1),
        "restored_tokens": on["restored_tokens"], "restore_ms_per_1k_tokens": on["restore_ms_per_1k"],
        "skipped_by_cost": on["skipped_by_cost"], "host_tier_mb": on["host_mb"],
        "pool_tokens": on["pool_tokens"], "working_set_tokens": working_set,
        "working_set_over_pool": round(working_set / on["pool_tokens"], 2),
        "tenants": args.tenants, "requests": args.requests, "warmup_per_tenant": 1, "output_tokens": args.output_tokens,
        "cpu": cpu_model(), "dtype": str(loaded.dtype).replace("torch.", ""), "kv_dtype": kv_dtype,
        "threads": torch.get_num_threads(), **machine_fields(load_before),
    }
    result["targets_met"] = result["ttft_p50_ratio"] <= TARGETS["ttft_p50_ratio"] and \
        result["cached_frac_on"] >= TARGETS["cached_frac_on"]
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
