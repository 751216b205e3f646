"""worker.server.process.memory: malloc_trim at most once per interval, oneDNN kernel caches bounded at worker
start (in a subprocess: the settings apply before the first matmul), and the opt-in memory report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import REPO
from worker.server.process.memory import (
    KERNEL_CACHE_CAPACITY,
    KERNEL_CACHE_ENV,
    REPORT_ENV,
    TRIM_ENV,
    MemoryReport,
    TrimSchedule,
)


def test_trims_at_most_once_per_interval() -> None:
    trim = TrimSchedule(interval=30.0)
    assert trim.available  # glibc on the Linux machines this project runs on
    assert trim.maybe_trim(100.0)
    assert not trim.maybe_trim(110.0)
    assert trim.maybe_trim(130.0)
    assert trim.trims == 2


def test_trim_interval_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(TRIM_ENV, "5")
    assert TrimSchedule().interval == 5.0
    monkeypatch.delenv(TRIM_ENV)
    assert TrimSchedule().interval == 30.0


_KERNEL_CACHE_PROBE = """
import json, os, sys, torch
from worker.server.process.memory import bound_native_memory, rss_mb
caches = bound_native_memory()
torch.set_num_threads(1)
w = torch.randn(256, 64, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(1, 64, dtype=torch.bfloat16), w)
before = rss_mb()
for m in range(2, 700):  # a distinct matmul shape each time, as a worker's step sizes vary
    torch.nn.functional.linear(torch.randn(m, 64, dtype=torch.bfloat16), w)
print(json.dumps({"caches": caches, "growth_mb": rss_mb() - before}))
"""


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _KERNEL_CACHE_PROBE], env={**os.environ, **env}, cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_kernel_caches_are_bounded_at_worker_start() -> None:
    """700 distinct bf16 matmul shapes: 458 MB of growth with oneDNN's default caches (1,024 entries) on this
    Zen 4 CPU, 231 MB at 256 entries, 121 MB at 128: up to about 1 MB an entry for these shapes."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_ENV}
    report = _probe({**env, "PYTHONPATH": str(REPO)})
    assert report["caches"] == {k: str(KERNEL_CACHE_CAPACITY) for k in KERNEL_CACHE_ENV}
    assert report["growth_mb"] < 1.0 * KERNEL_CACHE_CAPACITY + 40, report


def test_an_operator_setting_wins() -> None:
    report = _probe({"PYTHONPATH": str(REPO), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16",
                     "LRU_CACHE_CAPACITY": "16"})
    assert report["caches"] == {k: "16" for k in KERNEL_CACHE_ENV}
    assert report["growth_mb"] < 40, report


def test_memory_report_is_off_by_default_and_writes_json_lines(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(REPORT_ENV, raising=False)
    assert MemoryReport().path is None
    path = tmp_path / "mem-{pid}.jsonl"
    report = MemoryReport(path=str(path), interval=10.0)
    try:
        report.maybe_report(100.0)
        report.maybe_report(105.0)  # within the interval: nothing
        report.maybe_report(111.0)
    finally:
        report.close()
    lines = [json.loads(x) for x in Path(report.path).read_text().splitlines()]
    assert str(os.getpid()) in report.path and len(lines) == 2
    assert lines[0]["rss"] > 0 and lines[0]["anon"] > 0 and isinstance(lines[1]["py_growth"], list)
