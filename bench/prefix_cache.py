"""Prefix-cache benchmark: time to first token with a shared system prompt, cache off vs on, one run.

Targets on CPU: `ttft_warm_over_cold` <= 0.25, `prefill_tokens_saved_frac` >= 0.9 (--json for one line);
exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.machine import add_no_targets, exit_code
from worker.config import EngineConfig
from worker.engine.core import Engine, EngineStats
from worker.model.loader import LoadedModel, load_model
from worker.protocol import SamplingParams

TARGETS = {"ttft_warm_over_cold": 0.25, "prefill_tokens_saved_frac": 0.9}  # at most, at least
TOPICS = ("refunds", "shipping", "warranty", "privacy", "accounts", "payments", "returns", "discounts",
          "invoices", "deliveries", "repairs", "subscriptions", "gift cards", "loyalty points", "complaints",
          "order tracking")
CITIES = ("Lisbon", "Oslo", "Vienna", "Prague", "Dublin", "Madrid", "Helsinki", "Athens")


def system_prompt(tokenizer, target_tokens: int) -> str:
    """Support-desk rules, one per topic and then numbered, until the text is about `target_tokens` long."""
    rules: list[str] = ["You are the support assistant of a European online shop. Follow every rule below."]
    i = 0
    while len(tokenizer.encode(" ".join(rules), add_special_tokens=False)) < target_tokens:
        topic = TOPICS[i % len(TOPICS)]
        rules.append(f"Rule {i + 1}: when a customer asks about {topic}, answer in at most three sentences, "
                     f"quote the policy section on {topic} by its number, and never promise anything the "
                     f"policy does not state.")
        i += 1
    return " ".join(rules)


def questions(n: int) -> list[str]:
    return [f"Hi, I ordered item {100 + i} to {CITIES[i % len(CITIES)]}. What is your policy on "
            f"{TOPICS[(i * 5) % len(TOPICS)]}?" for i in range(n)]


def run(loaded: LoadedModel, prompts: list[list[int]], out_tokens: int, concurrency: int, cache: bool,
        max_batched: int) -> tuple[list[float], dict[str, list[int]], EngineStats, float]:
    """One pass over the workload: TTFT seconds per request, outputs, engine stats, wall seconds."""
    engine = Engine(loaded, EngineConfig(enable_prefix_cache=cache, kv_cache_bytes=1 << 30,
                                         max_num_batched_tokens=max_batched))
    engine.add_request("warmup", prompts[0][-40:], SamplingParams(max_tokens=2), namespace=b"warmup")
    while engine.has_work():
        engine.step()
    base_prefill = engine.stats().prefill_tokens_computed
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    nxt = in_flight = 0
    t0 = time.perf_counter()
    while nxt < len(prompts) or engine.has_work():
        while nxt < len(prompts) and in_flight < concurrency:
            rid = f"q{nxt}"
            added[rid] = time.perf_counter()
            engine.add_request(rid, prompts[nxt], params)
            outputs[rid] = []
            nxt += 1
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.new_tokens and out.rid not in ttft:
                ttft[out.rid] = now - added[out.rid]
            outputs[out.rid].extend(out.new_tokens)
            if out.finish_reason is not None:
                in_flight -= 1
    wall = time.perf_counter() - t0
    stats = engine.stats()
    stats.prefill_tokens_computed -= base_prefill
    assert all(len(v) == out_tokens for v in outputs.values()), "a request ended early"
    return [ttft[f"q{i}"] for i in range(len(prompts))], outputs, stats, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_no_targets(ap)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--dtype", default="auto", help="auto (the worker's choice) | bfloat16 | float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig().max_num_batched_tokens)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    loaded = load_model("default", dtype=args.dtype, device=args.device)
    tok = loaded.tokenizer
    system = system_prompt(tok, args.system_tokens)
    prompts = [tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": q}])
               for q in questions(args.questions)]
    results = {}
    for cache in (False, True):
        results[cache] = run(loaded, prompts, args.output_tokens, args.concurrency, cache,
                             args.max_num_batched_tokens)
        print(f"cache {'on' if cache else 'off'}: "
              f"ttft p50 {statistics.median(results[cache][0]) * 1e3:.1f} ms, "
              f"{results[cache][3]:.1f}s", file=sys.stderr, flush=True)
    (cold, cold_out, cold_stats, cold_wall), (warm, warm_out, warm_stats, warm_wall) = \
        results[False], results[True]
    cold_p50, warm_p50 = statistics.median(cold), statistics.median(warm)
    same = sum(cold_out[r] == warm_out[r] for r in cold_out) / len(cold_out)
    result = {
        "ttft_p50_cold_ms": round(cold_p50 * 1e3, 2),
        "ttft_p50_warm_ms": round(warm_p50 * 1e3, 2),
        "ttft_warm_over_cold": round(warm_p50 / cold_p50, 4),
        "ttft_p90_cold_ms": round(_p90(cold) * 1e3, 2),
        "ttft_p90_warm_ms": round(_p90(warm) * 1e3, 2),
        "prefill_tokens_saved_frac": round(1 - warm_stats.prefill_tokens_computed
                                           / cold_stats.prefill_tokens_computed, 4),
        "hit_rate": round(warm_stats.prefix_hit_rate, 4),
        "prefill_tokens_cold": cold_stats.prefill_tokens_computed,
        "prefill_tokens_warm": warm_stats.prefill_tokens_computed,
        "wall_s_cold": round(cold_wall, 2), "wall_s_warm": round(warm_wall, 2),
        "greedy_outputs_equal_frac": round(same, 4),
        "system_prompt_tokens": len(tok.encode(system, add_special_tokens=False)),
        "prompt_tokens_mean": round(statistics.mean(map(len, prompts)), 1),
        "requests": len(prompts), "output_tokens": args.output_tokens, "concurrency": args.concurrency,
        "dtype": str(loaded.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "targets": TARGETS,
    }
    result["met"] = {"ttft_warm_over_cold": result["ttft_warm_over_cold"] <= TARGETS["ttft_warm_over_cold"],
                     "prefill_tokens_saved_frac":
                         result["prefill_tokens_saved_frac"] >= TARGETS["prefill_tokens_saved_frac"]}
    if not args.json:
        for k, v in result.items():
            print(f"{k:>26}: {v}", file=sys.stderr)
    print(json.dumps(result))
    return exit_code(result, not args.no_targets)


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


if __name__ == "__main__":
    sys.exit(main())
