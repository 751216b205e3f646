"""Admission over one Redis and over a 3-primary Redis Cluster, in one run: the targets of issue #33.

Rounds alternate single / cluster (bench.admission's workers: authenticate + reserve + settle, N processes on
one tenant); one JSON line: over-admission (0), Redis round trips per admitted request (<= 2) from INFO
commandstats summed over every node (admission's own: EVALSHA, EVAL, ASKING; and all calls, with the tenant
directory's cache refreshes), and the p99 ratio cluster / single (<= 1.5), medians over the rounds.
Exits 1 when a target is missed. Run: `.venv/bin/python -m bench.admission_cluster --json`
"""

from __future__ import annotations

import argparse
import os
import statistics

import redis

from admission.lua.scripts import RESERVE, SETTLE
from bench.admission import COST, TENANT, _client_calls, _script_commands, spawn_workers
from bench.machine import add_no_targets, cpu_model, emit, machine_fields
from config.local_stack.launcher import start_redis_server
from config.local_stack.redis_cluster import RedisClusterProcs
from tenancy import create_tenant, issue_key, sync_client
from tenancy.schema import bucket_key, config_key, leases_key

ADMISSION_CALLS = ("evalsha", "eval", "asking")  # a script call, its NOSCRIPT fallback, an ASK redirection


def _counts(servers: list[redis.Redis], internal: set[str]) -> tuple[int, int]:
    """(client calls, admission script calls) over every server, from INFO commandstats."""
    total = script = 0
    for s in servers:
        total += _client_calls(s, internal)
        stats = s.info("commandstats")
        script += sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ADMISSION_CALLS)
    return total, script


def _primaries(url: str, cluster: RedisClusterProcs | None) -> list[redis.Redis]:
    """Plain clients of every server that may answer: the one Redis, or each cluster node."""
    if cluster is None:
        return [redis.Redis.from_url(url)]
    return [n.client() for n in cluster.nodes if n.proc is not None]


def one_run(url: str, cluster: RedisClusterProcs | None, procs: int, requests: int, inflight: int,
            budget_tokens: int) -> dict:
    r = sync_client(url)
    r.delete(config_key(TENANT), bucket_key(TENANT), leases_key(TENANT))
    create_tenant(r, TENANT, tpm=budget_tokens, rpm=0, max_concurrent=0)
    key = issue_key(r, TENANT)
    for script in (RESERVE, SETTLE):  # as a gateway would at start-up: no NOSCRIPT in the measured phase
        r.script_load(script.source)
    servers, internal = _primaries(url, cluster), _script_commands()
    workers, barrier, queue = spawn_workers(url, key, procs, requests, inflight)
    try:
        barrier.wait(timeout=60)
        (calls0, script0), (s0, us0) = _counts(servers, internal), servers[0].time()
        barrier.wait(timeout=60)  # the workers start now (bench.admission._worker)
        results = [queue.get(timeout=300) for _ in workers]
        (calls1, script1), (s1, us1) = _counts(servers, internal), servers[0].time()
    finally:
        for w in workers:
            w.join(timeout=10)
    elapsed = (s1 + us1 / 1e6) - (s0 + us0 / 1e6)
    latencies = sorted(x for res in results for x in res[0])
    admitted, denied = sum(res[1] for res in results), sum(res[2] for res in results)
    calls = calls1 - calls0 - 1  # less the TIME above (INFO is not counted)
    allowed = budget_tokens + budget_tokens * elapsed / 60  # the bucket plus its continuous refill
    for s in servers:
        s.close()
    r.delete(config_key(TENANT), bucket_key(TENANT), leases_key(TENANT))
    r.close()
    return {
        "admitted": admitted, "denied": denied,
        "over_admit_frac": max(0.0, admitted * COST - allowed) / budget_tokens,
        "round_trips_per_request": calls / max(1, len(latencies)),
        # a denied request costs one call (its reserve); an admitted one its reserve and settle, and (all
        # calls) its share of the tenant directory's cache refreshes (2 reads per key per 0.5 s per process)
        "admission_round_trips_per_admitted": (script1 - script0 - denied) / max(1, admitted),
        "round_trips_per_admitted": (calls - denied) / max(1, admitted),
        "p50_us": latencies[len(latencies) // 2],
        "p99_us": latencies[min(len(latencies) - 1, len(latencies) * 99 // 100)],
    }


def run(rounds: int, procs: int, requests: int, inflight: int, budget_tokens: int) -> dict:
    single_proc, single_url = start_redis_server()
    cluster = RedisClusterProcs(primaries=3)
    try:
        cluster.start()
        runs: dict[str, list[dict]] = {"single": [], "cluster": []}
        for _ in range(rounds):
            runs["single"].append(one_run(single_url, None, procs, requests, inflight, budget_tokens))
            runs["cluster"].append(one_run(cluster.url, cluster, procs, requests, inflight, budget_tokens))
    finally:
        cluster.stop()
        single_proc.terminate()
        single_proc.wait(timeout=10)
    out: dict = {"bench": "admission_cluster", "primaries": 3, "rounds": rounds, "processes": procs,
                 "requests": requests, "inflight": inflight, "budget_tokens": budget_tokens}
    for mode, results in runs.items():
        out[mode] = {
            "over_admit_frac": round(max(x["over_admit_frac"] for x in results), 6),
            "admission_round_trips_per_admitted": round(max(x["admission_round_trips_per_admitted"]
                                                            for x in results), 3),
            "round_trips_per_admitted": round(max(x["round_trips_per_admitted"] for x in results), 3),
            "round_trips_per_request": round(max(x["round_trips_per_request"] for x in results), 3),
            "p50_us": int(statistics.median(x["p50_us"] for x in results)),
            "p99_us": int(statistics.median(x["p99_us"] for x in results)),
            "admitted": [x["admitted"] for x in results],
        }
    out["p99_ratio"] = round(out["cluster"]["p99_us"] / max(1, out["single"]["p99_us"]), 3)
    out["p50_ratio"] = round(out["cluster"]["p50_us"] / max(1, out["single"]["p50_us"]), 3)
    out["targets_met"] = (out["cluster"]["over_admit_frac"] == 0 == out["single"]["over_admit_frac"]
                          and out["cluster"]["admission_round_trips_per_admitted"] <= 2
                          and out["p99_ratio"] <= 1.5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="single/cluster pairs; medians are reported")
    ap.add_argument("--processes", type=int, default=2, help="gateway-like processes")
    ap.add_argument("--requests", type=int, default=2000, help="per run, over all processes")
    ap.add_argument("--inflight", type=int, default=4, help="concurrent requests per process")
    ap.add_argument("--budget-tokens", type=int, default=100_000,
                    help="tenant tokens/min (default: half the offered load of 2000 x 100 tokens)")
    ap.add_argument("--json", action="store_true")
    add_no_targets(ap)
    args = ap.parse_args(argv)
    if min(args.rounds, args.processes, args.requests, args.inflight) < 1 or args.budget_tokens < COST:
        ap.error("rounds, processes, requests, inflight must be >= 1 and budget-tokens >= 100")
    load = os.getloadavg()
    result = run(args.rounds, args.processes, args.requests, args.inflight, args.budget_tokens)
    result.update({"cpu": cpu_model(), **machine_fields(load)})
    return emit(result, args.json, not args.no_targets)


if __name__ == "__main__":
    raise SystemExit(main())
