"""The Grafana dashboard is a valid dashboard model whose queries use exactly the metric contract."""

from __future__ import annotations

import json
import re

import pytest

from tests import REPO

DASHBOARD = REPO / "docker" / "grafana-dashboard.json"

# The metric-name contract shared by gateway, worker and dashboard (issue 8, DESIGN "Observability").
HISTOGRAMS = {
    "switchyard_ttft_seconds", "switchyard_inter_token_seconds", "switchyard_e2e_seconds",
    "switchyard_queue_seconds", "switchyard_worker_prefill_seconds", "switchyard_worker_queue_seconds",
    "switchyard_worker_step_seconds", "switchyard_worker_disagg_transfer_seconds",
}
OTHERS = {
    "switchyard_requests_total", "switchyard_prompt_tokens_total", "switchyard_completion_tokens_total",
    "switchyard_cached_tokens_total", "switchyard_rate_limited_total", "switchyard_shed_total",
    "switchyard_router_requests_total", "switchyard_router_outstanding_tokens",
    "switchyard_router_fallbacks_total", "switchyard_router_prefix_hit_rate",
    "switchyard_worker_running_requests", "switchyard_worker_waiting_requests",
    "switchyard_worker_kv_pages_used", "switchyard_worker_kv_pages_total",
    "switchyard_worker_prefix_hit_rate",
    "switchyard_worker_batch_size", "switchyard_worker_preemptions_total",
    "switchyard_worker_prompt_tokens_total", "switchyard_worker_cached_tokens_total",
    "switchyard_worker_generated_tokens_total",
    "switchyard_disagg_requests_total", "switchyard_disagg_fallbacks_total",
    "switchyard_worker_disagg_fallbacks_total", "switchyard_worker_disagg_received_bytes_total",
    "switchyard_worker_prefill_tokens_computed_total",
}
# The KV tiers below the radix cache (worker.server.telemetry.worker_metrics: TIER_*),
# all on the "KV tiers" row.
KV_TIERS = {
    "switchyard_worker_kv_tier_hits_total", "switchyard_worker_kv_tier_evictions_total",
    "switchyard_worker_kv_tier_bytes", "switchyard_worker_kv_tier_load_seconds_total",
    "switchyard_worker_kv_tier_restored_tokens_total", "switchyard_worker_kv_tier_restored_bytes_total",
    "switchyard_worker_kv_tier_disk_writes_total", "switchyard_worker_kv_tier_disk_corrupt_total",
    "switchyard_worker_kv_tier_skipped_by_cost_total", "switchyard_worker_kv_tier_disk_full",
}
OTHERS |= KV_TIERS
CONTRACT = HISTOGRAMS | OTHERS
GAUGES = {  # `_kv_pages_total` is a gauge (pages in the pool), not a counter
    "switchyard_router_outstanding_tokens", "switchyard_router_prefix_hit_rate",
    "switchyard_worker_running_requests", "switchyard_worker_waiting_requests",
    "switchyard_worker_kv_pages_used", "switchyard_worker_kv_pages_total",
    "switchyard_worker_prefix_hit_rate", "switchyard_worker_batch_size", "switchyard_worker_kv_tier_bytes",
    "switchyard_worker_kv_tier_disk_full",
}
COUNTERS = OTHERS - GAUGES
# The worker's model-server-protocol gauges (worker.server.telemetry.msp_metrics)
# that Kubernetes routers read.
ROUTER_GAUGES = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
NAME = re.compile(r"\bswitchyard_[a-z0-9_]+")
VLLM_NAME = re.compile(r"\bvllm:[a-z0-9_]+")
QUANTILE = re.compile(r"histogram_quantile\(\s*(0?\.\d+|1(?:\.0)?)\s*,"
                      r"\s*sum by \(([^)]*)\)\s*\(rate\((\w+)\[")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return out


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


def _base_name(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
            return name[: -len(suffix)]
    return name


def test_dashboard_model_shape(dashboard: dict) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys()
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["title"] and p["targets"], f"panel {p['id']} has no title or queries"
        assert p["datasource"]["uid"] == "${datasource}"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"panel {p['title']!r}: duplicate refId"


def test_panels_do_not_overlap(dashboard: dict) -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_exprs_are_balanced(dashboard: dict) -> None:
    pairs = {")": "(", "]": "[", "}": "{"}
    for expr in _exprs(dashboard):
        stack: list[str] = []
        for ch in re.sub(r'"[^"]*"', '""', expr):  # ignore brackets inside label matchers' strings
            if ch in "([{":
                stack.append(ch)
            elif ch in pairs:
                assert stack and stack.pop() == pairs[ch], f"unbalanced {expr!r}"
        assert not stack, f"unbalanced {expr!r}"


def test_metric_names_match_the_contract_both_ways(dashboard: dict) -> None:
    used = {_base_name(n) for expr in _exprs(dashboard) for n in NAME.findall(expr)}
    assert used - CONTRACT == set(), f"names outside the contract: {sorted(used - CONTRACT)}"
    assert CONTRACT - used == set(), f"contract metrics missing from the dashboard: {sorted(CONTRACT - used)}"


def test_router_protocol_gauges_are_on_the_dashboard_and_never_rated(dashboard: dict) -> None:
    exprs = _exprs(dashboard)
    assert {n for expr in exprs for n in VLLM_NAME.findall(expr)} == ROUTER_GAUGES
    assert not [e for e in exprs if "rate(vllm:" in e]


def test_histograms_are_queried_as_quantiles_over_bucket_rates(dashboard: dict) -> None:
    seen: dict[str, set[float]] = {}
    for expr in _exprs(dashboard):
        for name in NAME.findall(expr):
            if name in HISTOGRAMS:
                pytest.fail(f"histogram {name} used without a _bucket/_sum/_count suffix: {expr!r}")
        for q, by, series in QUANTILE.findall(expr):
            assert series.endswith("_bucket") and _base_name(series) in HISTOGRAMS, expr
            assert "le" in [s.strip() for s in by.split(",")], f"quantile must aggregate by le: {expr!r}"
            seen.setdefault(_base_name(series), set()).add(float(q))
    assert set(seen) == HISTOGRAMS
    for name in ("switchyard_ttft_seconds", "switchyard_inter_token_seconds",
                 "switchyard_e2e_seconds", "switchyard_queue_seconds"):
        assert {0.5, 0.95, 0.99} <= seen[name], f"{name}: p50/p95/p99 expected, got {sorted(seen[name])}"


def test_counters_are_rated_and_labelled_panels_split_by_label(dashboard: dict) -> None:
    exprs = _exprs(dashboard)
    for expr in exprs:
        for name in NAME.findall(expr):
            if name in COUNTERS:
                assert re.search(rf"rate\({name}(\{{[^}}]*\}})?\[", expr), \
                    f"counter {name} not rated: {expr!r}"
            if name in GAUGES:
                assert f"rate({name}" not in expr, f"gauge {name} must not be rated: {expr!r}"
    joined = "\n".join(exprs)
    assert "sum by (status) (rate(switchyard_requests_total" in joined
    assert "sum by (reason) (rate(switchyard_rate_limited_total" in joined
    assert "sum by (reason) (rate(switchyard_shed_total" in joined


def _row(dashboard: dict, title: str) -> list[dict]:
    """The panels under the (expanded) row titled `title`, up to the next row."""
    panels, inside = [], False
    for p in dashboard["panels"]:
        if p["type"] == "row":
            inside = p["title"] == title
        elif inside:
            panels.append(p)
    return panels


def test_kv_tiers_row_plots_every_tier_metric_the_worker_exports(dashboard: dict) -> None:
    """The row's tier names are exactly the worker's `_kv_tier_` collectors (a new one must get a panel), and
    the per-tier counters and the occupancy gauge are split by tier."""
    from prometheus_client import REGISTRY

    import worker.server.telemetry.worker_metrics  # noqa: F401 - registers its collectors on import

    panels = _row(dashboard, "KV tiers")
    assert len(panels) >= 5
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = {n for e in exprs for n in NAME.findall(e) if "_kv_tier_" in n}
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in REGISTRY.collect()
                if f.name.startswith("switchyard_worker_kv_tier_")}
    assert used == exported == KV_TIERS
    joined = "\n".join(exprs)
    for name in ("switchyard_worker_kv_tier_hits_total", "switchyard_worker_kv_tier_evictions_total"):
        assert f"sum by (tier) (rate({name}" in joined, f"{name} not split by tier"
    assert "tier) (switchyard_worker_kv_tier_bytes)" in joined


def test_contract_matches_the_collectors_the_code_registers() -> None:
    """The gateway, router and worker metric modules expose every contract name with the expected type."""
    from prometheus_client import REGISTRY, CollectorRegistry

    import router.placement.routing_metrics  # noqa: F401 - registers its collectors on import
    import worker.server.telemetry.worker_metrics  # noqa: F401
    from gateway.telemetry.gateway_metrics import GatewayMetrics

    gateway_registry = CollectorRegistry()
    GatewayMetrics(registry=gateway_registry)
    exposed: dict[str, str] = {}
    for registry in (REGISTRY, gateway_registry):
        for family in registry.collect():
            if family.name.startswith("switchyard_"):
                exposed[family.name + ("_total" if family.type == "counter" else "")] = family.type
    expected = {**{n: "histogram" for n in HISTOGRAMS}, **{n: "gauge" for n in GAUGES},
                **{n: "counter" for n in COUNTERS}}
    assert {n: exposed.get(n) for n in expected} == expected
    router = {f.name: f.type for f in REGISTRY.collect() if f.name in ROUTER_GAUGES}
    assert router == dict.fromkeys(ROUTER_GAUGES, "gauge")
