"""Benchmark: prefix-aware routing vs round-robin vs one big worker (the hit-rate oracle), pooled over orders,
with the router run by N gateway processes at once (`--gateways 1,3`: clients split across them).

Prints one JSON line (hit rates, TTFT p50, max/mean load, routing precision, per N under `by_gateways`); the
method is in docs/benchmarks.md. Targets (`met`): hit rate >= 0.9x the oracle's and >= 2.5x
round-robin's, TTFT p50 <= 0.5x round-robin's, `max_over_mean_load` <= 1 + epsilon + 0.1, precision p50
>= 0.9, no errors; with several N, the last N's hit rate >= 0.95x the first's and >= 0.9x the oracle's.
Exits 1 when one is missed (`--no-targets`: 0). `--json` prints only the line.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.machine import add_no_targets, cpu_model, emit
from common.priorities import Priority
from config.local_stack.launcher import WorkerProc
from router import Membership, Router, RouteRequest, WorkerError, namespace_root
from worker.protocol import SamplingParams

SECRET = b"bench-routing"
MODES = ("router", "round_robin", "oracle")


def kv_bytes_per_token(model: str, dtype: str | None) -> int:
    """KV bytes per token of the workers' model in the dtype they will pick (so caches hold `--kv-tokens`)."""
    import torch

    from worker.kvcache.tensors import bytes_per_token
    from worker.model.loader import gguf_config, pick_dtype
    from worker.model.tiny_model import TINY_SPEC, tiny_config
    from worker.text.gguf_index import read_index
    from worker.text.model_source import resolve

    if model == TINY_SPEC:
        return bytes_per_token(tiny_config(1, None, None),
                               pick_dtype(dtype or "float32", torch.device("cpu")))
    src = resolve(model)
    if src.kind != "gguf":
        raise SystemExit("pass --kv-bytes-per-token for a Hugging Face folder model")
    return bytes_per_token(gguf_config(read_index(src.path).meta), pick_dtype(dtype, torch.device("cpu")))


@dataclass(slots=True)
class Result:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    error: str | None = None
    predicted: int = -1  # prompt tokens the router expected cached (-1: not routed)


def build_workload(seed: int, n_prompts: int, prompt_len: int,
                   per_prompt: int) -> list[tuple[int, list[int]]]:
    """(system prompt index, tokens) in random order; tokens are ids in a safe range of the vocabulary."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(n_prompts)]
    work = []
    for p, system in enumerate(systems):
        for _ in range(per_prompt):
            work.append((p, system + [rng.randrange(100, 40000) for _ in range(rng.randint(12, 24))]))
    rng.shuffle(work)
    return work


async def stream_direct(client, rid: str, ns: bytes, tokens: list[int], sampling: SamplingParams) -> Result:
    t0 = time.perf_counter()
    ttft, cached = None, 0
    async for chunk in client.generate(rid, ns, tokens, sampling, Priority.INTERACTIVE, time.time() + 300):
        if ttft is None and chunk.tokens:
            ttft = time.perf_counter() - t0
        cached = max(cached, chunk.cached_tokens)
        if chunk.finish_reason is not None:
            break
    return Result(len(tokens), cached, ttft if ttft is not None else float("nan"))


async def stream_routed(router: Router, req: RouteRequest, samples: list[dict[str, float]]) -> Result:
    t0 = time.perf_counter()
    ttft, cached = None, 0
    gen = router.stream(req)
    try:
        async for chunk in gen:
            if ttft is None:
                samples.append(router.loads.loads())  # includes this request, just sent
            if ttft is None and chunk.tokens:
                ttft = time.perf_counter() - t0
            cached = max(cached, chunk.cached_tokens)
            if chunk.finish_reason is not None:
                break
    finally:
        await gen.aclose()
    return Result(len(req.tokens), cached, ttft if ttft is not None else float("nan"))


async def run_mode(mode: str, membership: Membership, cluster: list[str], oracle: str,
                   work: list[tuple[int, list[int]]], args: argparse.Namespace, seed: int) -> list[Result]:
    """Round-robin over the cluster, or everything to the oracle, from this process."""
    ns = namespace_root(args.model, "bench", f"{mode}-{seed}", SECRET)  # no run reuses another's cache
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i: int, tokens: list[int]) -> Result:
        async with sem:
            target = cluster[i % len(cluster)] if mode == "round_robin" else oracle
            try:
                return await stream_direct(membership.client(target), f"{mode}-{seed}-{i}", ns,
                                           tokens, sampling)
            except WorkerError as err:
                return Result(len(tokens), 0, float("nan"), err.code)

    # Requests are issued in order; the semaphore keeps `concurrency` in flight.
    return await asyncio.gather(*(one(i, toks) for i, (_, toks) in enumerate(work)))


async def gateway_share(g: int, n_gateways: int, cluster: list[str], work: list[tuple[int, list[int]]],
                        args: argparse.Namespace, seed: int,
                        barrier) -> tuple[list[Result], list[dict[str, float]]]:
    """One gateway replica's part: its own membership, sockets and router; requests i = g mod N, with its
    share of the concurrency. All replicas (and the parent) pass `barrier` once each sees the cluster live."""
    membership = Membership(gateway_id=f"bench-gw{g}", static_endpoints=cluster, dead_after=args.dead_after)
    samples: list[dict[str, float]] = []
    try:
        await membership.start()
        await membership.wait_until(lambda m: len(m.live()) == len(cluster), timeout=args.ready_timeout)
        router = Router(membership, secret=SECRET, route_prefix_tokens=args.prompt_len, epsilon=args.epsilon)
        predicted: dict[str, int] = {}
        router.on_precision(lambda rid, _w, p, _a: predicted.__setitem__(rid, p))
        barrier.wait(timeout=args.ready_timeout)  # blocks this process's loop: nothing else runs here yet
        ns = namespace_root(args.model, "bench", f"router{n_gateways}-{seed}", SECRET)
        sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        sem = asyncio.Semaphore(max(1, round(args.concurrency / n_gateways)))

        async def one(i: int, tokens: list[int]) -> Result:
            async with sem:
                rid = f"router{n_gateways}-{seed}-{i}"
                req = RouteRequest(rid=rid, ns=ns, tokens=tokens, cost=len(tokens) + args.max_tokens,
                                   sampling=sampling, stable_len=args.prompt_len)
                try:
                    result = await stream_routed(router, req, samples)
                except WorkerError as err:
                    result = Result(len(tokens), 0, float("nan"), err.code)
                result.predicted = predicted.pop(rid, -1)
                return result

        mine = [(i, toks) for i, (_, toks) in enumerate(work) if i % n_gateways == g]
        return await asyncio.gather(*(one(i, toks) for i, toks in mine)), samples
    finally:
        await membership.close()


def gateway_process(g: int, n_gateways: int, cluster: list[str], work, args, seed: int, barrier,
                    results) -> None:
    out, samples = asyncio.run(gateway_share(g, n_gateways, cluster, work, args, seed, barrier))
    results.put((g, [(r.prompt_tokens, r.cached_tokens, r.ttft_s, r.error, r.predicted)
                     for r in out], samples))


def run_gateways(n_gateways: int, cluster: list[str], work: list[tuple[int, list[int]]],
                 args: argparse.Namespace, seed: int) -> tuple[list[Result], list[dict[str, float]]]:
    """The router mode from `n_gateways` gateway processes at once; returns their pooled results and loads."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(n_gateways + 1), ctx.Queue()
    procs = [ctx.Process(target=gateway_process,
                         args=(g, n_gateways, cluster, work, args, seed, barrier, results),
                         daemon=True) for g in range(n_gateways)]
    for p in procs:
        p.start()
    pooled: list[Result] = []
    samples: list[dict[str, float]] = []
    try:
        barrier.wait(timeout=args.ready_timeout)  # every replica connected and sees the workers live
        deadline = time.monotonic() + args.run_timeout
        for _ in procs:
            while True:  # a replica that died sends nothing: do not wait out the whole timeout for it
                try:
                    _, rows, their_samples = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                        raise RuntimeError("a gateway process ended without results") from None
            pooled += [Result(*row) for row in rows]
            samples += their_samples
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return pooled, samples


def precision_p50(results: list[Result]) -> float | None:
    """Median over requests with a predicted hit of the share of the predicted tokens really cached."""
    shares = [min(r.predicted, r.cached_tokens) / r.predicted for r in results
              if r.error is None and r.predicted > 0]
    return round(statistics.median(shares), 3) if shares else None


def summarize(results: list[Result]) -> tuple[float, float]:
    """(hit rate, ttft p50 ms) over the requests that completed."""
    ok = [r for r in results if r.error is None]
    if not ok:
        return 0.0, float("nan")
    hit = sum(r.cached_tokens for r in ok) / sum(r.prompt_tokens for r in ok)
    return round(hit, 4), round(statistics.median(r.ttft_s for r in ok) * 1000, 1)


def load_ratio(samples: list[dict[str, float]], cluster: list[str]) -> float:
    means = [statistics.fmean(s.get(w, 0.0) for s in samples) for w in cluster]
    return round(max(means) / statistics.fmean(means), 3)


def oracle_kv_tokens(args: argparse.Namespace) -> int:
    """The cluster's total cache, or more if that cannot hold the
    whole workload: the oracle must not thrash."""
    working_set = int(1.1 * args.prompts * (args.prompt_len + 32)) + args.concurrency * (32 + args.max_tokens)
    return max(3 * args.kv_tokens, working_set)


async def bench(args: argparse.Namespace, log_dir: Path) -> dict:
    bytes_per_token = args.kv_bytes_per_token or kv_bytes_per_token(args.model, args.dtype)
    common = ["--stats-interval", "0.1", "--max-num-batched-tokens", str(args.max_batched_tokens)]
    common += ["--dtype", args.dtype] if args.dtype else []
    procs = [WorkerProc(log_dir, model=args.model, threads=args.threads,
                        extra=common + ["--kv-cache-bytes", str(args.kv_tokens * bytes_per_token)])
             for _ in range(3)]
    procs.append(WorkerProc(log_dir, model=args.model, threads=args.threads,
                            extra=common + ["--kv-cache-bytes",
                                            str(oracle_kv_tokens(args) * bytes_per_token)]))
    # WorkerProc passes its own --kv-cache-bytes first; ours, later on the command line, wins.
    cluster, oracle = [p.endpoint for p in procs[:3]], procs[3].endpoint
    membership = Membership(gateway_id="bench-routing", static_endpoints=cluster + [oracle],
                            dead_after=args.dead_after)
    try:
        await membership.start()
        await membership.wait_until(lambda m: len(m.live()) == 4, timeout=args.ready_timeout)
        modes = [f"router{n}" for n in args.gateways] + ["round_robin", "oracle"]
        out: dict = {"hit_rate": {}, "ttft_p50_ms": {}, "hit_rate_per_order": {}, "wall_s": {}, "errors": {}}
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        pooled: dict[str, list[Result]] = {mode: [] for mode in modes}
        for seed in range(args.seed, args.seed + args.orders):
            work = build_workload(seed, args.prompts, args.prompt_len, args.per_prompt)
            for mode in modes:
                t0 = time.perf_counter()
                if mode.startswith("router"):
                    results, their = await asyncio.to_thread(run_gateways, int(mode[6:]), cluster,
                                                             work, args, seed)
                    samples[mode] += their
                else:
                    results = await run_mode(mode, membership, cluster, oracle, work, args, seed)
                pooled[mode] += results
                out["hit_rate_per_order"].setdefault(mode, []).append(summarize(results)[0])
                print(f"seed {seed} {mode}: hit rate, ttft p50 ms {summarize(results)}, precision p50 "
                      f"{precision_p50(results)}, {time.perf_counter() - t0:.0f}s", file=sys.stderr)
                out["wall_s"][mode] = round(out["wall_s"].get(mode, 0.0) + time.perf_counter() - t0, 1)
        for mode, results in pooled.items():
            out["hit_rate"][mode], out["ttft_p50_ms"][mode] = summarize(results)
            out["errors"][mode] = sum(r.error is not None for r in results)
        first = f"router{args.gateways[0]}"
        by_n = {str(n): {"hit_rate": out["hit_rate"][f"router{n}"],
                         "ttft_p50_ms": out["ttft_p50_ms"][f"router{n}"],
                         "max_over_mean_load": load_ratio(samples[f"router{n}"], cluster),
                         "precision_p50": precision_p50(pooled[f"router{n}"])} for n in args.gateways}
        for key in ("hit_rate", "ttft_p50_ms", "hit_rate_per_order", "wall_s", "errors"):
            out[key]["router"] = out[key].pop(first)  # today's fields: the first N under "router"
        out["max_over_mean_load"] = by_n[str(args.gateways[0])]["max_over_mean_load"]
        out["precision_p50"] = by_n[str(args.gateways[0])]["precision_p50"]
        out["by_gateways"] = by_n
        out["kv_tokens_per_worker"] = {ep: membership.member(ep).stats.kv_total for ep in cluster + [oracle]}
        hr, tt = out["hit_rate"], out["ttft_p50_ms"]
        out["checks"] = {
            "hit_vs_oracle": round(hr["router"] / hr["oracle"], 3) if hr["oracle"] else None,
            "hit_vs_round_robin": round(hr["router"] / hr["round_robin"], 3) if hr["round_robin"] else None,
            "ttft_vs_round_robin": round(tt["router"] / tt["round_robin"], 3),
        }
        if len(args.gateways) > 1:
            last = str(args.gateways[-1])
            out["checks"][f"hit_{last}gw_vs_{args.gateways[0]}gw"] = (
                round(by_n[last]["hit_rate"] / hr["router"], 3) if hr["router"] else None)
            out["checks"][f"hit_{last}gw_vs_oracle"] = (
                round(by_n[last]["hit_rate"] / hr["oracle"], 3) if hr["oracle"] else None)
        out["met"] = routing_met(out, args.epsilon)
        out.update(model=args.model, workers=3, gateways=args.gateways, orders=args.orders,
                   requests=len(pooled[first]), concurrency=args.concurrency, prompt_len=args.prompt_len,
                   max_tokens=args.max_tokens, epsilon=args.epsilon, cpu=cpu_model(),
                   dtype=args.dtype or "auto")
        return out
    finally:
        await membership.close()
        for p in procs:
            p.stop()


def routing_met(out: dict, epsilon: float) -> dict[str, bool]:
    """The targets against the line's `checks`, load ratio, precision and errors (None misses)."""
    def at_least(v: float | None, floor: float) -> bool:
        return v is not None and v >= floor

    checks, precision = out["checks"], out["precision_p50"]
    met = {"hit_vs_oracle": at_least(checks["hit_vs_oracle"], 0.9),
           "hit_vs_round_robin": at_least(checks["hit_vs_round_robin"], 2.5),
           "ttft_vs_round_robin": checks["ttft_vs_round_robin"] <= 0.5,
           "max_over_mean_load": out["max_over_mean_load"] <= 1 + epsilon + 0.1,
           "precision_p50": at_least(precision, 0.9), "no_errors": not any(out["errors"].values())}
    for key, value in checks.items():
        if key.endswith("gw_vs_oracle"):
            met[key] = at_least(value, 0.9)
        elif "gw_vs_" in key:
            met[key] = at_least(value, 0.95)
    return met


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    add_no_targets(ap)
    ap.add_argument("--model", default="default", help="worker model spec ('default', 'tiny-random', path)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    ap.add_argument("--kv-tokens", type=int, default=3800,
                    help="KV cache tokens per cluster worker (about 6 of the 16 system prompts)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=None,
                    help="default: computed from the model's shape and the dtype the workers pick")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--per-prompt", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--epsilon", type=float, default=0.25)
    ap.add_argument("--max-batched-tokens", type=int, default=256,
                    help="worker step token budget (bounds a step, so stats keep flowing on a busy CPU)")
    ap.add_argument("--dead-after", type=float, default=10.0,
                    help="seconds without stats before a worker counts as lost (CPU steps can be long)")
    ap.add_argument("--seed", type=int, default=1, help="the first order's seed; order k uses seed + k")
    ap.add_argument("--orders", type=int, default=5,
                    help="random orders of the workload, each run by all three modes; "
                    "hit rates and TTFT pool them")
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--gateways", default="1",
                    help="comma list of gateway process counts, each run over the same orders (e.g. 1,3)")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds one gateway process may take")
    args = ap.parse_args(argv)
    try:
        args.gateways = [int(n) for n in args.gateways.split(",") if n.strip()]
    except ValueError:
        ap.error("--gateways must be a comma list of positive integers")
    if not args.gateways or min(args.gateways) < 1:
        ap.error("--gateways must be a comma list of positive integers")
    with tempfile.TemporaryDirectory(prefix="sy-bench-routing-") as tmp:
        result = asyncio.run(bench(args, Path(tmp)))
    return emit(result, args.json, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
