"""A worker loads the C++ kernels from the library path an earlier load recorded, without importing torch's
cpp_extension (and setuptools: 0.3 s of a start); a record that does not fit is ignored."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from worker.kernels import cpu as cpu_kernels

REPO = Path(__file__).resolve().parents[3]
PROBE = ("import sys, worker.kernels.cpu as c; m = c.extension(); "
         "print(m is not None and hasattr(m, 'paged_decode'), 'torch.utils.cpp_extension' in sys.modules)")


def _probe(cache: Path) -> str:
    env = {**os.environ, "SWITCHYARD_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_second_process_loads_the_recorded_library(tmp_path):
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (no compiler): nothing is recorded")
    assert _probe(tmp_path) == "True True"  # found through torch, then recorded
    record = tmp_path / "switchyard" / "kernels" / f"{cpu_kernels._NAME}.path"
    assert Path(record.read_text()).is_file()
    assert _probe(tmp_path) == "True False"  # the record: torch's cpp_extension never imported


def test_a_record_that_does_not_fit_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path))
    record = cpu_kernels._record_path(cpu_kernels._NAME)
    record.parent.mkdir(parents=True)
    other = tmp_path / "switchyard_cpu_000000000000.so"  # another build's library
    other.write_bytes(b"not a library")
    for target in (tmp_path / "gone" / f"{cpu_kernels._NAME}.so", other):
        record.write_text(str(target))
        assert cpu_kernels._load_recorded(cpu_kernels._NAME) is None
    torn = tmp_path / f"{cpu_kernels._NAME}.so"  # the right name, but not a loadable library
    torn.write_bytes(b"\x7fELF torn")
    record.write_text(str(torn))
    assert cpu_kernels._load_recorded(cpu_kernels._NAME) is None


def test_records_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "MAX_RECORDS", 2)
    for i in range(4):
        cpu_kernels._record(f"switchyard_cpu_{i:012d}", SimpleNamespace(__file__=f"/x/{i}.so"))
        time.sleep(0.01)  # distinct modification times
    kept = sorted(p.name for p in cpu_kernels._record_path("x").parent.glob("*.path"))
    assert kept == ["switchyard_cpu_000000000002.path", "switchyard_cpu_000000000003.path"]
