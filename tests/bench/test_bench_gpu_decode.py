"""`bench/gpu_decode.py --cpu-smoke`: the GPU bench's own code runs end to end on CPU under Triton's
interpreter (a tiny shape, batches 1 and 2) and prints its one JSON line; its times mean nothing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests import REPO

# find_spec, not importorskip: no triton import at collection (tests/conftest.py sets TRITON_INTERPRET=1 first
# anyway, so that the Triton tests' kernels are interpreted on CPU whatever the order)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")


@pytest.mark.heavy  # half a minute under the interpreter: `make test-heavy`
def test_cpu_smoke_run_prints_the_benchs_json_line():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_decode", "--cpu-smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["bench"] == "gpu_decode" and line["copy_bw_GBps"] > 0
    # no sold bandwidth off CUDA, and the tiny shape has no targets (the exit code is 0)
    assert line["sold_bw_GBps"] is None and line["met"] == {}
    (result,) = line["results"]
    assert "error" not in result, result
    assert (result["attention_backend"] == "triton" and result["shape"] == "tiny"
            and result["prefill_tok_s"] > 0)
    assert set(result["decode"]) == {"1", "2"}
    for row in result["decode"].values():
        assert row["floor_ms"] > 0 and row["eager_ms"] > 0 and row["floor_sold_ms"] is None


def test_sold_bandwidth_by_device_name_and_the_8b_targets():
    from bench.gpu_decode import sold_bandwidth, targets_met

    assert sold_bandwidth("NVIDIA H200") == 4.8e12 and sold_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert sold_bandwidth("NVIDIA GH200 480GB") is None and sold_bandwidth("Tesla T4") is None
    rows = {"1": {"x_floor": 1.33, "x_floor_sold": 1.6, "graph_speedup": 4.4},
            "64": {"x_floor": 1.34, "x_floor_sold": 1.51}}
    result = {"shape": "llama-8b", "quantization": "none", "decode": rows}
    assert all(targets_met(result).values())
    assert targets_met(result, "x_floor_sold") == {"x_floor_b1": False, "x_floor_b64": True,
                                                   "graph_speedup_b1": True}
    assert targets_met({"shape": "tiny", "quantization": "none", "decode": rows}) is None
    assert not any(targets_met({"shape": "llama-8b", "quantization": "none", "error": "OOM"}).values())
