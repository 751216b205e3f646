"""Open-loop load: Poisson arrivals at set request rates over a natural-text workload, with goodput.

Requests arrive at exponential gaps (seeded), whatever the server's pace, as users do (a closed loop waits
for a slot and so never overloads). Per rate: output tokens/s, TTFT and TPOT percentiles, and goodput, the
requests per second whose own TTFT and TPOT both meet the SLO (DistServe's definition). A stream short of its
`max_tokens` or any error fails the run. Runs with the peers' python (stdlib and httpx), as
`bench/long_loadgen.py` does: `open_loop.py PEER_LOADGEN --url URL --key KEY --rates 0.5,1,2 --n 48
[--workload ntrace] [--slo-ttft-ms 2000 --slo-tpot-ms 200]`. Its line holds the prompts' SHA-256.
"""

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_loadgen import checked, natural, prompts_sha256  # noqa: E402 - run as a script beside it


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Start offsets (seconds) of `n` requests arriving as a Poisson process of `rate` per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def summary(rate: float, results: list[dict], wall: float, slo_ttft: float, slo_tpot: float) -> dict:
    """One rate's figures; `results` are the shared generator's records (ttft and tpot in seconds)."""
    ok = [r for r in results if "error" not in r]
    good = [r for r in ok if r["ttft"] is not None and r["ttft"] <= slo_ttft
            and (r["tpot"] is None or r["tpot"] <= slo_tpot)]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    return {"rate": rate, "n": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "wall_s": round(wall, 2),
            "out_tok_s": round(sum(r["out"] for r in ok) / wall, 1) if wall else 0.0,
            "ttft_p50_ms": _ms(pct(ttft, 50)), "ttft_p99_ms": _ms(pct(ttft, 99)),
            "tpot_p50_ms": _ms(pct(tpot, 50)), "tpot_p99_ms": _ms(pct(tpot, 99)),
            "goodput_rps": round(len(good) / wall, 3) if wall else 0.0,
            "slo_met_frac": round(len(good) / len(results), 3) if results else 0.0}


async def warm_up(one, args: argparse.Namespace) -> None:  # noqa: ANN001 - the shared coroutine
    """A few requests one at a time, not counted: first-use costs (kernel JIT, caches) stay out."""
    import httpx

    out: list[dict] = []
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        for prompt, max_tokens in natural(args.workload, args.warmup, args.seed + 1000):
            await one(client, args, prompt, max_tokens, out)
    errors = [r for r in out if "error" in r]
    if errors:
        raise SystemExit(f"warm-up failed: {errors[0]}")


async def run_rate(one, args: argparse.Namespace, rate: float, seed: int,  # noqa: ANN001
                   digests: list[str]) -> dict:
    """One rate's requests (`one`: the shared generator's coroutine); each rate has its own prompts
    (`seed`), so no rate meets the prefix cache another one filled."""
    import httpx

    reqs = natural(args.workload, args.n, seed)
    digests.append(prompts_sha256(reqs))
    starts = arrivals(rate, args.n, seed)
    out: list[dict] = []
    limits = httpx.Limits(max_connections=args.n + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def at(offset: float, prompt: str, max_tokens: int) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            await one(client, args, prompt, max_tokens, out)

        await asyncio.gather(*(at(s, p, m) for s, (p, m) in zip(starts, reqs, strict=True)))
        wall = time.perf_counter() - t0
    return summary(rate, out, wall, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)


def main() -> int:
    path, argv = sys.argv[1], sys.argv[2:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--key", default="")
    ap.add_argument("--model", default="default")
    ap.add_argument("--workload", default="nmixed", choices=["nmixed", "ntrace"])
    ap.add_argument("--rates", default="0.5,1,2", help="requests per second, comma-separated, lowest first")
    ap.add_argument("--n", type=int, default=48, help="requests per rate")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=4, help="requests sent one at a time first, not counted")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    args = ap.parse_args(argv)
    spec = importlib.util.spec_from_file_location("peer_loadgen", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    one = checked(peer.one)
    asyncio.run(warm_up(one, args))
    rates = [float(r) for r in args.rates.split(",")]
    digests: list[str] = []
    rows = [asyncio.run(run_rate(one, args, rate, args.seed + i, digests)) for i, rate in enumerate(rates)]
    print(json.dumps({"bench": "open_loop", "workload": args.workload, "slo_ttft_ms": args.slo_ttft_ms,
                      "slo_tpot_ms": args.slo_tpot_ms, "rates": rows,
                      "max_goodput_rps": max(r["goodput_rps"] for r in rows),
                      "prompts_sha256": prompts_sha256(digests)}))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
