"""KV tiers benchmark: T tenants, each with its own ~1,000-token system prompt, a working set of at least 4x the KV
pool, requests in random tenant order; tiers off vs on (host RAM at its auto size) in one process, alternating.

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


class Side:
    """One engine (tiers off or on) with its TTFTs and cached share; requests run one at a time."""

    def __init__(self, loaded: LoadedModel, systems: list[list[int]], args: argparse.Namespace, tiers: bool,
                 pages: int, kv_dtype: str) -> None:
        per_page = bytes_per_page(loaded.config, loaded.dtype, args.block_size, kv_dtype)
        self.engine = Engine(loaded, EngineConfig(kv_cache_bytes=pages * per_page, kv_dtype=kv_dtype,
                                                  block_size=args.block_size, kv_host_bytes=None if tiers else 0))
        self.systems, self.tok = systems, loaded.tokenizer
        self.params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
        self.ttft: list[float] = []
        self.cached = self.prompt = 0

    def one(self, rid: str, tenant: int, i: int, timed: bool = True) -> None:
        engine, prompt = self.engine, self.systems[tenant] + question(self.tok, i)
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, self.params, namespace=b"tenant-%d" % tenant)
        ttft, cached = None, 0
        while engine.has_work():
            for out in engine.step():
                if ttft is None and out.new_tokens:
                    ttft, cached = time.perf_counter() - t0, out.cached_tokens
        assert ttft is not None
        if timed:
            self.ttft.append(ttft)
            self.cached += cached
            self.prompt += len(prompt)

    def result(self) -> dict:
        st = self.engine.stats()
        self.engine.close()
        ts = st.tiers
        return {"ttft": self.ttft, "cached_frac": self.cached / self.prompt, "pool_tokens": st.kv_total_tokens,
                "restored_tokens": ts.restored_tokens if ts else 0,
                "host_mb": round(ts.ram_bytes / 2**20, 1) if ts else 0,
                "skipped_by_cost": ts.skipped_by_cost if ts else 0,
                "restore_ms_per_1k": round(1e6 * ts.load_seconds / ts.restored_tokens, 2)
                if ts and ts.restored_tokens else None}


def run(loaded: LoadedModel, systems: list[list[int]], order: list[int], args: argparse.Namespace, pages: int,
        kv_dtype: str) -> dict[bool, dict]:
    """Both engines warm each tenant once (untimed); then each timed request runs on both, the one going first
    alternating, so a load change on a shared machine falls on both sides alike."""
    sides = {tiers: Side(loaded, systems, args, tiers, pages, kv_dtype) for tiers in (False, True)}
    for side in sides.values():
        for t in range(len(systems)):
            side.one(f"warm{t}", t, 10_000 + t, timed=False)
    for i, t in enumerate(order):
        for tiers in ((False, True) if i % 2 == 0 else (True, False)):
            sides[tiers].one(f"q{i}", t, i)
    return {tiers: side.result() for tiers, side in sides.items()}


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
    res = run(loaded, systems, order, args, pages, kv_dtype)
    for tiers in (False, True):
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
