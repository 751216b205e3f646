"""`bench/batch_slo.py` in a tiny configuration (tiny-random worker, 3-s arms): one JSON line with every
figure of both arms, and exit code 0 under `--no-targets`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a worker, a gateway and a Redis of its own (about 16-25 s): a multi-process run, `make test-heavy`
pytestmark = [pytest.mark.timeout(120), pytest.mark.heavy]
REPO = Path(__file__).resolve().parents[2]
ARM_FIELDS = ("requests", "admitted", "shed_slo", "shed_other", "errors", "slo_attainment", "shed_frac",
              "ttft_p50_ms", "ttft_p99_ms", "gateway_slo_counts")


def test_tiny_batch_slo_run_prints_both_arms() -> None:
    cmd = [sys.executable, "-m", "bench.batch_slo", "--json", "--no-targets", "--model", "tiny-random",
           "--seconds", "3", "--calib-s", "2", "--calib-conc", "4", "--overload", "1", "--unloaded-n", "3",
           "--warmup", "2", "--slo-ms", "2000"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=110)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert len(lines) == 1, proc.stdout + proc.stderr[-2000:]
    result = json.loads(lines[0])
    assert result["bench"] == "batch_slo" and result["part"] == "deadlines" and result["cpu"]
    assert result["capacity_rps"] > 0 and result["slo_ms"] == 2000
    for name in ("deadlines", "no_deadlines"):
        arm = result["arms"][name]
        assert all(f in arm for f in ARM_FIELDS), arm
        assert arm["requests"] == arm["admitted"] + arm["shed_slo"] + arm["shed_other"] + arm["errors"]
        assert arm["errors"] == 0, arm
    assert result["arms"]["deadlines"]["gateway_slo_counts"].get("target") == \
        result["arms"]["deadlines"]["requests"]
    assert result["arms"]["no_deadlines"]["shed_slo"] == 0
    assert set(result["met"]) == {"slo_attainment", "errors"}
