"""`bench/budgets.py` in a tiny configuration on one Redis: one JSON line with every figure, money exact, and
an exit code that says whether every target was met."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a worker, gateways and Redis servers of its own (about 12 s): a multi-process run, `make test-heavy`
pytestmark = [pytest.mark.timeout(240), pytest.mark.heavy]
REPO = Path(__file__).resolve().parents[2]
FIELDS = ("overspend_usd", "budget_utilization", "spend_mismatch_usd", "per_request_mismatches",
          "admission_p99_overhead_ms", "final_utilization", "held_after_usd", "requests")


def test_tiny_budgets_run_prints_the_figures_and_meets_the_targets() -> None:
    cmd = [sys.executable, "-m", "bench.budgets", "--json", "--modes", "single", "--gateways", "1",
           "--clients", "4", "--max-tokens", "8", "--budget-requests", "150", "--latency-samples", "1000",
           "--tail-s", "3", "--max-seconds", "40"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=220)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr[-2000:]
    result = json.loads(lines[0])
    single = result["single"]
    assert all(f in single for f in FIELDS), single
    assert single["overspend_usd"] == 0 and single["spend_mismatch_usd"] == 0
    assert single["requests"]["completed"] > 0 and single["requests"]["refused"] > 0
    met = result["met"]["single"]
    assert result["cpu"] and met["overspend_usd"] and met["spend_mismatch_usd"], lines[0]
    # the latency figure on a busy 2-core machine decides only the exit code, which must say it
    assert proc.returncode == (0 if all(met.values()) else 1), lines[0]
