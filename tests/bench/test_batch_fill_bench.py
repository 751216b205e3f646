"""`bench/batch_fill.py` in a tiny configuration (tiny-random worker, 3-s arms, a 1,000-line batch): one JSON
line with both interactive arms and the batch's figures, and exit code 0 under `--no-targets`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a worker, a gateway with the Batch API and a Redis of its own: a multi-process run, `make test-heavy`
pytestmark = [pytest.mark.timeout(150), pytest.mark.heavy]
REPO = Path(__file__).resolve().parents[2]


def test_tiny_batch_fill_run_prints_the_ratio_and_the_fill() -> None:
    cmd = [sys.executable, "-m", "bench.batch_fill", "--json", "--no-targets", "--model", "tiny-random",
           "--seconds", "3", "--calib-s", "2", "--calib-conc", "4", "--lines", "1000", "--batch-alone-s", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=140)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert len(lines) == 1, proc.stdout + proc.stderr[-2000:]
    result = json.loads(lines[0])
    assert result["bench"] == "batch_fill" and result["cpu"]
    for arm in (result["alone"], result["with_batch"]):
        assert arm["errors"] == 0 and arm["completed"] == arm["requests"] > 0, arm
    assert result["batch_lines_in_window"] > 0 and result["batch_out_tok_s"] > 0
    assert result["capacity_out_tok_s"] >= result["batch_alone_out_tok_s"] > 0
    assert result["interactive_ttft_p99_ratio"] > 0 and result["batch_idle_fill"] > 0
    assert set(result["met"]) == {"interactive_ttft_p99_ratio", "batch_idle_fill", "errors"}
