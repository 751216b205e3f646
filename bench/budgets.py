"""Dollar budgets under load: 3 gateways over one Redis and a 3-primary cluster, spend exact to the micro.

Per Redis mode: one organization (2 projects x 4 keys, a budget at every level of the organization -> project
-> key -> user path, the organization's binding) takes `--clients` concurrent streaming chats (random
`max_tokens`, some cancelled mid-stream, each with its own `user` id) until its budget is exhausted. Figures:
`overspend_usd` (recorded spend beyond the budget), `budget_utilization` (the organization's settled spend /
budget read right after the first `insufficient_quota` refusal), `spend_mismatch_usd` (the largest |sum of
per-request costs - recorded spend| over the balance, the spend hash and `/v1/organization/costs`; a request's
cost is computed from the usage returned to its client, a cancelled one's, which its client never gets, is
the ledger's record of its `user`), `per_request_mismatches` (completed requests whose recorded cost differs
from their usage's), and `admission_p99_overhead_ms` (four-level minus flat admission p99, bench.budgets_load
`admission_latency`). One JSON line; exit 1 when a target is missed. Run: `python -m bench.budgets --json`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
import time
import urllib.parse
from pathlib import Path

import httpx

from admission.money.admin_keys import create_admin_key
from admission.money.hierarchy import assign_project, read_balance, read_spend, set_budget, set_limits
from admission.money.keys import micro_to_usd
from admission.money.prices import set_price
from bench.budgets_load import Load, Prices, admission_latency, usage_cost
from bench.machine import cpu_model, emit, machine_fields
from config.local_stack.launcher import GatewayProc, WorkerProc, start_redis_server, wait_for_port
from config.local_stack.redis_cluster import RedisClusterProcs
from tenancy import create_tenant, issue_key, sync_client
from tenancy.apikeys import digest

ORG, PROJECTS, KEYS_PER_PROJECT = "bench", ("alpha", "beta"), 4
PRICES = Prices(input="37.3", cached="12.1", output="151.7")  # USD per million tokens: fractional micro-USD
TARGETS = {"overspend_usd": "== 0", "spend_mismatch_usd": "== 0", "per_request_mismatches": "== 0",
           "budget_utilization": ">= 0.95", "admission_p99_overhead_ms": "<= 1.0"}


def set_up(url: str, budget_usd: str) -> tuple[list[tuple[str, str]], str, str]:
    """The organization, its projects and keys, prices and budgets; a latency tenant in an org of its own.
    Returns ((project, key) pairs, the latency tenant's key, its project)."""
    r = sync_client(url)
    set_price(r, "*", PRICES.input, PRICES.cached, PRICES.output)
    keys = []
    set_budget(r, ORG, "organization", ORG, budget_usd, "day")
    # rates and concurrency that never bind, so that every branch of the hold script runs
    set_limits(r, ORG, "organization", ORG, tpm=10**9, max_concurrent=10**6)
    for project in PROJECTS:
        create_tenant(r, project, tpm=0, rpm=0, max_concurrent=0)
        assign_project(r, project, ORG)
        set_budget(r, ORG, "project", project, budget_usd, "day")
        set_budget(r, ORG, "project", project, "5", "day", user_default=True)
        set_limits(r, ORG, "project", project, tpm=10**9, rpm=10**6, user_default=True)
        for _ in range(KEYS_PER_PROJECT):
            key = issue_key(r, project)
            set_budget(r, ORG, "key", digest(key), budget_usd, "month")
            set_limits(r, ORG, "key", digest(key), rpm=10**6, max_concurrent=10**6)
            keys.append((project, key))
    lat_org, lat_project = "latency", "lat"
    create_tenant(r, lat_project, tpm=0, rpm=0, max_concurrent=0)
    assign_project(r, lat_project, lat_org)
    lat_key = issue_key(r, lat_project)
    set_budget(r, lat_org, "organization", lat_org, "100000", "day")
    set_budget(r, lat_org, "project", lat_project, "100000", "day")
    set_budget(r, lat_org, "project", lat_project, "1000", "day", user_default=True)
    set_budget(r, lat_org, "key", digest(lat_key), "100000", "day")
    set_limits(r, lat_org, "organization", lat_org, tpm=10**9, max_concurrent=10**6)
    set_limits(r, lat_org, "key", digest(lat_key), rpm=10**6, max_concurrent=10**6)
    set_limits(r, lat_org, "project", lat_project, tpm=10**9, rpm=10**6, user_default=True)
    create_tenant(r, "warmup", tpm=0, rpm=0, max_concurrent=0)  # organization `default`: no budget
    r.close()
    return keys, lat_key, lat_project


def start_gateways(log_dir: Path, url: str, worker: WorkerProc, n: int) -> list[GatewayProc]:
    config = log_dir / "gateway.toml"
    config.write_text("[gateway]\nmoney_budgets = true\n")
    gws = [GatewayProc.spawn(log_dir, ["--config", str(config), "--redis-url", url, "--workers",
                                       worker.endpoint, "--worker-timeout", "10", "--log-level", "WARNING"])
           for _ in range(n)]
    deadline = time.monotonic() + 120
    while not all(g.ready() for g in gws):
        if any(g.proc.poll() is not None for g in gws) or time.monotonic() > deadline:
            for g in gws:
                g.stop()
            raise RuntimeError(f"a gateway did not start; logs in {log_dir}")
        time.sleep(0.25)
    return gws


async def warm_up(gateways: list[GatewayProc], key: str, concurrent: int) -> None:
    """Concurrent 1-token requests to each gateway: pools and caches warm before the measured load."""
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as http:
        codes = await asyncio.gather(*(http.post(g.base_url + "/v1/chat/completions", json=body,
                                                 headers={"authorization": f"Bearer {key}"})
                                       for g in gateways for _ in range(concurrent)))
    if not any(c.status_code == 200 for c in codes):
        raise RuntimeError(f"no warm-up request succeeded: {codes[0].status_code} {codes[0].text[:200]}")


async def drive(url: str, gateways: list[GatewayProc], keys: list[tuple[str, str]], budget: int,
                args: argparse.Namespace) -> tuple[Load, dict]:
    """Run the load until the organization's budget is exhausted: refused once, and what is left cannot hold
    the cheapest request (the shortest prompt seen, max_tokens 1); or `--tail-s` after the first refusal, or
    `--max-seconds`. Then wait for every hold to be settled."""
    from tenancy import async_client

    client = async_client(url)
    state: dict = {"spent_at_refusal": None}
    refused = asyncio.Event()
    load = Load([g.base_url for g in gateways], keys, args.clients, args.max_tokens, args.cancel_frac,
                args.seed, lambda _msg: refused.set())
    bal = f"{{o:{ORG}}}:bal:organization:{ORG}"

    async def watch() -> None:
        await refused.wait()
        spent = await client.hget(bal, "spent")  # right after the first refusal: settled spend then
        state["spent_at_refusal"] = int(spent or 0)
        state["first_refusal_s"] = round(time.monotonic() - t0, 2)

    async def until_exhausted() -> None:
        while time.monotonic() - t0 < args.max_seconds:
            await asyncio.sleep(0.1)
            prompts = [o.usage["prompt_tokens"] for o in load.outcomes[-200:] if o.usage]
            spent, held = await client.hmget(bal, "spent", "held")
            left = budget - int(spent or 0) - int(held or 0)
            if refused.is_set() and prompts and left < PRICES.max_cost_micro(min(prompts), 1):
                state["stopped_by"] = "exhausted"
                break
            if refused.is_set() and time.monotonic() - t0 - state.get("first_refusal_s", 1e9) > args.tail_s:
                state["stopped_by"] = "tail"
                break
        else:
            state["stopped_by"] = "max_seconds"
        load.stop.set()

    t0 = time.monotonic()
    watcher = asyncio.create_task(watch())
    await asyncio.gather(load.run(), until_exhausted())
    state["load_s"] = round(time.monotonic() - t0, 2)
    watcher.cancel()
    deadline = time.monotonic() + 30
    while int(await client.hget(bal, "held") or 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # cancelled streams settle once their gateway sees the client gone
    await client.aclose()
    return load, state


def costs_api_micro(gateway: GatewayProc, admin_key: str) -> int:
    start = int(time.time()) - 2 * 86_400
    q = urllib.parse.urlencode({"start_time": start, "limit": 7})
    resp = httpx.get(f"{gateway.base_url}/v1/organization/costs?{q}", timeout=30,
                     headers={"authorization": f"Bearer {admin_key}"})
    resp.raise_for_status()
    return sum(round(res["amount"]["value"] * 1_000_000) for b in resp.json()["data"] for res in b["results"])


def figures(url: str, gateways: list[GatewayProc], load: Load, state: dict, budget: int) -> dict:
    r = sync_client(url)
    balance = read_balance(r, ORG, "organization", ORG)
    days = read_spend(r, ORG, 2)
    spend = {k: sum(d.get(k, 0) for d in days.values()) for k in {k for d in days.values() for k in d}}
    admin_key, _ = create_admin_key(r, ORG, "bench")
    api_total = costs_api_micro(gateways[0], admin_key)
    r.close()
    per_user = {k.split("|")[0][len("user:"):]: v for k, v in spend.items()
                if k.startswith("user:") and k.endswith("|cost_micro")}
    served = [o for o in load.outcomes if o.kind in ("completed", "cancelled")]
    total, per_request_bad, cancelled_over_max, unrecorded = 0, 0, 0, 0
    for o in served:
        recorded = per_user.pop(f"{o.project}/{o.user}", None)
        if o.kind == "completed":
            cost = usage_cost(PRICES, o.usage or {})
            per_request_bad += recorded != cost
        else:
            cost = recorded or 0  # the client never sees a cancelled stream's usage: the ledger's record
            unrecorded += recorded is None
            cancelled_over_max += cost > PRICES.max_cost_micro(10_000, o.max_tokens)
        total += cost
    # Requests the ledger charged that no client counted as served (an error after tokens): charged anyway.
    total += sum(per_user.values())
    recorded = {"balance": balance["spent_micro"], "spend_hash": spend.get("org|cost_micro", 0),
                "costs_api": api_total}
    kinds = {k: sum(o.kind == k for o in load.outcomes)
             for k in ("completed", "cancelled", "refused", "error")}
    errors = sorted({o.detail for o in load.outcomes if o.kind == "error"})
    spent_at_refusal = state["spent_at_refusal"]
    return {
        "overspend_usd": float(micro_to_usd(max(0, balance["spent_micro"] - budget))),
        "budget_utilization": None if spent_at_refusal is None else round(spent_at_refusal / budget, 4),
        "spend_mismatch_usd": float(micro_to_usd(max(abs(total - v) for v in recorded.values()))),
        "per_request_mismatches": per_request_bad,
        "final_utilization": round(balance["spent_micro"] / budget, 4),
        "held_after_usd": float(micro_to_usd(balance["held_micro"])),
        "recorded_usd": {k: micro_to_usd(v) for k, v in recorded.items()},
        "client_sum_usd": micro_to_usd(total), "uncounted_charged": len(per_user),
        "cancelled_unrecorded": unrecorded, "cancelled_over_max": cancelled_over_max,
        "first_refusal_used_or_held_usd": load.first_refusal_used_usd,
        "requests": kinds, "errors": errors[:5], **state,
    }


def run_mode(mode: str, worker: WorkerProc, log_dir: Path, args: argparse.Namespace) -> dict:
    proc, cluster = None, None
    if mode == "single":
        proc, url = start_redis_server()
    else:
        cluster = RedisClusterProcs(primaries=3)
        cluster.start()
        url = cluster.url
    gateways: list[GatewayProc] = []
    try:
        budget = args.budget_requests * PRICES.max_cost_micro(40, max(1, args.max_tokens // 2))
        budget_usd = micro_to_usd(budget)
        keys, lat_key, lat_project = set_up(url, budget_usd)
        gateways = start_gateways(log_dir, url, worker, args.gateways)
        time.sleep(1.1)  # every gateway's 1 s view of prices and organizations
        warm_key = issue_key(sync_client(url), "warmup")
        asyncio.run(warm_up(gateways, warm_key, 4))
        latency = asyncio.run(admission_latency(url, lat_key, lat_project, args.latency_samples))
        load, state = asyncio.run(drive(url, gateways, keys, budget, args))
        out = {"budget_usd": budget_usd, **figures(url, gateways, load, state, budget)}
        out["admission"] = latency
        out["admission_p99_overhead_ms"] = latency.pop("p99_overhead_ms")
        return out
    finally:
        for g in gateways:
            g.stop()
        if cluster is not None:
            cluster.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


def met(res: dict) -> dict[str, bool]:
    util = res["budget_utilization"]
    return {"overspend_usd": res["overspend_usd"] == 0, "spend_mismatch_usd": res["spend_mismatch_usd"] == 0,
            "per_request_mismatches": res["per_request_mismatches"] == 0,
            "budget_utilization": util is not None and util >= 0.95,
            "admission_p99_overhead_ms": res["admission_p99_overhead_ms"] <= 1.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="single,cluster", help="single, cluster or both (comma-separated)")
    ap.add_argument("--gateways", type=int, default=3)
    ap.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    ap.add_argument("--max-tokens", type=int, default=32, help="each request's max_tokens: uniform 1..this")
    ap.add_argument("--cancel-frac", type=float, default=0.25, help="share of streams closed mid-way")
    ap.add_argument("--budget-requests", type=int, default=2000,
                    help="the organization's budget: this many requests' maximum cost (40-token "
                         "prompt, max_tokens/2 out)")
    ap.add_argument("--tail-s", type=float, default=10.0, help="load after the first refusal, at most")
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--latency-samples", type=int, default=2000, help="admission timings per path")
    ap.add_argument("--seed", type=int, default=53)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"single", "cluster"} or min(args.gateways, args.clients) < 1:
        ap.error("--modes takes single and/or cluster; gateways and clients >= 1")
    load_before = os.getloadavg()
    log_dir = Path(tempfile.mkdtemp(prefix="sy-bench-budgets-"))
    worker = WorkerProc(log_dir)  # tiny-random, shared by both modes (the gateways list it)
    try:
        wait_for_port(worker.port, 120)
        result: dict = {"bench": "budgets", "gateways": args.gateways, "clients": args.clients,
                        "max_tokens": args.max_tokens, "cancel_frac": args.cancel_frac,
                        "prices_usd_per_mtok": dataclasses.asdict(PRICES)}
        for mode in modes:
            result[mode] = run_mode(mode, worker, log_dir, args)
    finally:
        worker.stop()
    result["targets"] = TARGETS
    result["met"] = {m: met(result[m]) for m in modes}
    result.update({"cpu": cpu_model(), **machine_fields(load_before)})
    emit(result, args.json)
    return 0 if all(all(v.values()) for v in result["met"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
