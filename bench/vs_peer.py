"""Benchmark: Switchyard against a peer server (vLLM), matched precision and best vs best, side by side.

Per pass, one system up at a time: ours at the peer's precision with no quantization and no speculation
(`matched`), the peer, ours in its speed profile (`best`: w8a8, int8 KV pages, n-gram speculation), and that
profile without speculation on the single-stream workload (`best_nospec`). vLLM's best documented CPU
configuration is its `matched` one (bf16 on AVX-512 BF16 CPUs, fp32 on AVX2; its int8 W8A8 path needs a
compressed-tensors checkpoint), so the peer runs once per pass and serves both comparisons.

Workloads (`bench/long_loadgen.py`, natural text): `ntrace` (lengths from the Azure LLM inference trace
2023's conversation service; closed loop, and open loop with Poisson arrivals at fractions of ours' measured
capacity, with goodput at a TTFT and TPOT SLO), `nprefix`, `nsingle`; `--workloads` adds the random-word set.
Any error, a request short of its `max_tokens`, or prompts that differ between sides fail the run. One JSON
line: each side's configuration and figures, the median ratios per comparison, our speculation acceptance,
and `targets_met`; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench import peer_sides
from bench.machine import add_no_targets, cpu_model, emit, serving_dtype
from bench.peer_sides import LOADGEN, Config, Server
from worker.kernels.cpu_features import cpu_flags

PRIMARY = ("ntrace", "nprefix", "nsingle")
SECONDARY = ("mixed", "prefix", "single", "long", "nmixed")
# workload -> (n, concurrency): full runs, and --quick (a smoke test, not a figure)
FULL = {"ntrace": (64, 16), "nprefix": (32, 8), "nsingle": (8, 1), "mixed": (64, 16), "prefix": (32, 8),
        "single": (8, 1), "long": (16, 8), "nmixed": (64, 16)}
QUICK = {w: (max(2, n // 8), max(1, c // 4)) for w, (n, c) in FULL.items()}
# ratio name -> (workload, field); all ours / peer; "open" is the open-loop run
RATIOS = {"trace_out_tok_s": ("ntrace", "out_tok_s"), "goodput_rps": ("open", "max_goodput_rps"),
          "prefix_ttft_p50": ("nprefix", "ttft_p50_ms"), "single_tpot_p50": ("nsingle", "tpot_p50_ms"),
          "single_ttft_p50": ("nsingle", "ttft_p50_ms"), "rw_mixed_out_tok_s": ("mixed", "out_tok_s"),
          "rw_prefix_ttft_p50": ("prefix", "ttft_p50_ms"), "rw_single_tpot_p50": ("single", "tpot_p50_ms"),
          "long_out_tok_s": ("long", "out_tok_s"), "natural_mixed_out_tok_s": ("nmixed", "out_tok_s")}
# comparison -> ratio -> (">=" or "<=", bound); best's throughput bounds are 1.5 on AVX2-only CPUs
TARGETS = {"matched": {"trace_out_tok_s": (">=", 1.3), "goodput_rps": (">=", 1.3),
                       "prefix_ttft_p50": ("<=", 0.5), "single_tpot_p50": ("<=", 0.8),
                       "single_ttft_p50": ("<=", 1.0)},
           "best": {"trace_out_tok_s": (">=", 1.8), "goodput_rps": (">=", 1.8),
                    "prefix_ttft_p50": ("<=", 0.5)}}

WARM_SEED = 1000  # the warm-up's prompts (the counted workloads use seed 1)

Starter = Callable[[Config], Server]


def configs(args: argparse.Namespace) -> list[Config]:
    """The sides of one pass, in the order they run."""
    dtype = serving_dtype(args.dtype)
    matched = Config("ours", "matched", dtype, "none", "model", False,
                     ["--dtype", dtype, "--quantization", "none", "--kv-dtype", "model", "--spec-tokens", "0",
                      "--num-threads", str(args.threads)])
    peer = Config("peer", "peer", dtype, "none", dtype, False, peer_env={"VLLM_DTYPE": dtype})
    best_args = ["--quantization", "w8a8", "--kv-dtype", "int8", "--num-threads", str(args.threads)]
    best = Config("ours", "best", serving_dtype("auto"), "w8a8", "int8", True, best_args)
    nospec = Config("ours", "best_nospec", best.dtype, "w8a8", "int8", False,
                    [*best_args, "--spec-tokens", "0"])
    wanted = {"peer", *args.compare, *(["best_nospec"] if "best" in args.compare else [])}
    return [c for c in (matched, peer, best, nospec) if c.label in wanted]


def workloads_of(config: Config, args: argparse.Namespace) -> list[str]:
    if config.label == "best_nospec":
        return ["nsingle"] if "nsingle" in args.workloads else []
    return [w for w in (*PRIMARY, *SECONDARY) if w in args.workloads]


def run_side(start: Starter, config: Config, args: argparse.Namespace, capacity: list[float]) -> dict:
    """One configuration's figures: closed-loop workloads, then the open loop on `ntrace` at fractions of
    `capacity` (the closed-loop `ntrace` requests/s of the first side that ran it: ours' matched one)."""
    sizes = QUICK if args.quick else FULL
    server = start(config)
    try:
        # first-use costs (kernel JIT, primitive caches) stay out: prompts no counted workload sends
        peer_sides.run_workload(server, "nmixed", 4, 2, args.loadgen, args.request_timeout,
                                args.workload_timeout, seed=WARM_SEED)
        figures = {w: peer_sides.run_workload(server, w, *sizes[w], args.loadgen, args.request_timeout,
                                              args.workload_timeout) for w in workloads_of(config, args)}
        if "ntrace" in figures and not capacity:
            capacity.append(figures["ntrace"]["ok"] / figures["ntrace"]["wall_s"])
        if args.open_loop and capacity and config.label != "best_nospec":
            rates = [round(f * capacity[0], 3) for f in args.open_loop]
            figures["open"] = peer_sides.run_open_loop(server, "ntrace", rates, sizes["ntrace"][0] // 2 or 2,
                                                       args.slo_ttft_ms, args.slo_tpot_ms, args.loadgen,
                                                       args.request_timeout, args.workload_timeout)
        counters = peer_sides.spec_counters(server.metrics_url)
        if counters is not None:
            proposed, accepted = counters
            figures["speculation"] = {"proposed": proposed, "accepted": accepted,
                                      "acceptance_rate": round(accepted / proposed, 3) if proposed else None}
        return figures
    finally:
        server.stop()


def same_prompts(passes: list[dict[str, dict]]) -> None:
    """Every side of every pass sent each workload the same prompts (the load generators' digests)."""
    seen: dict[str, set] = {}
    for p in passes:
        for figures in p.values():
            for w, res in figures.items():
                if isinstance(res, dict) and "prompts_sha256" in res:
                    seen.setdefault(w, set()).add(res["prompts_sha256"])
    differ = sorted(w for w, digests in seen.items() if len(digests) > 1 or None in digests)
    if differ:
        raise RuntimeError(f"prompts differ between sides (or were not reported) for {differ}")


def ratios(passes: list[dict[str, dict]], ours: str, peer: str = "peer") -> dict[str, float | None]:
    """Median over passes of `ours` ÷ `peer` for each figure in RATIOS (None when a side has no figure)."""
    out: dict[str, float | None] = {}
    for name, (workload, fld) in RATIOS.items():
        vals = []
        for p in passes:
            a = p.get(ours, {}).get(workload, {}).get(fld)
            b = p.get(peer, {}).get(workload, {}).get(fld)
            if isinstance(a, int | float) and isinstance(b, int | float) and b > 0 and a == a:
                vals.append(a / b)
        out[name] = round(statistics.median(vals), 3) if vals else None
    return out


def speculation(passes: list[dict[str, dict]]) -> dict:
    """Ours' best profile with and without speculation on `nsingle`: its TPOT ratio (on ÷ off; the target
    is never worse than off) and acceptance rate."""
    tpot = ratios(passes, "best", "best_nospec")["single_tpot_p50"]
    rates = [p["best"]["speculation"]["acceptance_rate"] for p in passes
             if p.get("best", {}).get("speculation", {}).get("acceptance_rate") is not None]
    return {"single_tpot_on_over_off": tpot,
            "acceptance_rate": round(statistics.median(rates), 3) if rates else None}


def verdict(result: dict, avx512: bool) -> dict[str, bool]:
    """Each measured target: met or not (unmeasured ones are left out)."""
    met: dict[str, bool] = {}
    for comparison, bounds in TARGETS.items():
        for name, (op, bound) in bounds.items():
            value = result["ratios"].get(comparison, {}).get(name)
            if comparison == "best" and name in ("trace_out_tok_s", "goodput_rps") and not avx512:
                bound = 1.5
            if value is not None:
                met[f"{comparison}.{name}"] = value >= bound if op == ">=" else value <= bound
    spec = result["speculation"]["single_tpot_on_over_off"]
    if spec is not None:
        met["speculation_never_worse"] = spec <= 1.0
    return met


def compare(args: argparse.Namespace, start: Starter) -> dict:
    """Every pass's sides in order, never two up at once; the checked, summarised JSON line."""
    sides = configs(args)
    passes: list[dict[str, dict]] = []
    capacity: list[float] = []
    for i in range(args.passes):
        done = {}
        for config in sides:
            done[config.label] = run_side(start, config, args, capacity)
            print(f"pass {i + 1} {config.label}: {done[config.label]}", file=sys.stderr,
                  flush=True)
        passes.append(done)
    same_prompts(passes)
    labels = [c.label for c in sides]
    result = {"bench": "vs_peer", "quick": args.quick, "cpu": cpu_model(), "cores": os.cpu_count(),
              "model": args.model, "configs": {c.label: c.describe() for c in sides},
              "open_loop": {"fractions_of_capacity": args.open_loop, "capacity_rps": capacity[:1],
                            "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms},
              "passes": passes,
              "ratios": {c: ratios(passes, c) for c in ("matched", "best") if c in labels},
              "speculation": speculation(passes)}
    result["targets_met"] = verdict(result, "avx512f" in cpu_flags())
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-url", default="http://127.0.0.1:8101")
    ap.add_argument("--peer-model", default="smollm2")
    ap.add_argument("--peer-key", default="")
    ap.add_argument("--peer-start", default=None, help="command that starts the peer and prints its PID "
                    "(e.g. ../shared/peers/start_vllm.sh); it gets VLLM_DTYPE=<the matched dtype>")
    ap.add_argument("--peer-stop", default=None,
                    help="command that stops it, given that PID (e.g. stop_vllm.sh)")
    ap.add_argument("--peer-ready-timeout", type=float, default=600.0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="the matched precision (auto: bf16 on AVX-512 BF16 CPUs, else fp32)")
    ap.add_argument("--compare", nargs="+", choices=["matched", "best"], default=["matched", "best"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the worker's torch threads")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small n per workload (a smoke test, not a figure)")
    ap.add_argument("--workloads", nargs="*", choices=list(FULL), default=list(PRIMARY),
                    help=f"closed-loop workloads (default: {' '.join(PRIMARY)}; the random-word set: "
                         f"{' '.join(SECONDARY)})")
    ap.add_argument("--open-loop", type=lambda s: [float(x) for x in s.split(",") if x],
                    default=[0.5, 1.0, 1.5], help="open-loop rates as fractions of ours' closed-loop ntrace "
                    "requests/s, comma-separated ('' for none)")
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0, help="goodput's TTFT bound per request")
    ap.add_argument("--slo-tpot-ms", type=float, default=150.0, help="goodput's TPOT bound per request")
    ap.add_argument("--loadgen", type=Path, default=LOADGEN)
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="our stack's start-up deadline")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--workload-timeout", type=float, default=1800.0)
    add_no_targets(ap)
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error("--passes must be >= 1")
    if bool(args.peer_start) != bool(args.peer_stop):
        ap.error("--peer-start and --peer-stop go together (never leave a peer running)")
    if not args.loadgen.exists():
        ap.error(f"load generator {args.loadgen} not found (--loadgen)")
    return args


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally`s that stop whichever side is up


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)
    with tempfile.TemporaryDirectory(prefix="vs-peer-") as tmp:
        counter = iter(range(1_000))

        def start(config: Config) -> Server:
            if config.system == "peer":
                return peer_sides.start_peer(config, args.peer_url, args.peer_key, args.peer_model,
                                             args.peer_start, args.peer_stop, args.peer_ready_timeout)
            log_dir = Path(tmp) / f"ours{next(counter)}"
            return peer_sides.start_ours(config, args.model, args.ready_timeout, log_dir)

        result = compare(args, start)
    return emit(result, as_json=True, enforce=not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
