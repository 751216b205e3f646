"""`bench.admission_cluster` end to end, small: its JSON fields, no
over-admission, two admission round trips."""

from __future__ import annotations

import pytest

from bench.admission_cluster import run

pytestmark = [pytest.mark.redis_cluster, pytest.mark.timeout(120)]


def test_bench_measures_single_and_cluster_in_one_run() -> None:
    out = run(rounds=1, procs=1, requests=300, inflight=2, budget_tokens=15_000)  # half the offered load
    for mode in ("single", "cluster"):
        m = out[mode]
        assert m["over_admit_frac"] == 0.0, out
        assert 150 <= m["admitted"][0] < 300, out  # the budget bit: about half were denied
        assert m["admission_round_trips_per_admitted"] == 2.0, out  # reserve + settle, no redirect, no reload
        assert 2.0 <= m["round_trips_per_admitted"] < 2.2 and 0 < m["p50_us"] <= m["p99_us"], out
    assert out["p99_ratio"] > 0 and isinstance(out["targets_met"], bool)
