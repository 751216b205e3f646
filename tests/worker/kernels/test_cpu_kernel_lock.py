"""The C++ kernel's build never hangs a worker on a lock left by a killed compile."""

from __future__ import annotations

import os
import time
from pathlib import Path

from worker.kernels import cpu as cpu_kernels


def _lock(tmp_path: Path, monkeypatch, age_s: float) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "sy_test_ext" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_stale_lock_is_removed_at_once(tmp_path, monkeypatch):
    lock = _lock(tmp_path, monkeypatch, age_s=cpu_kernels.STALE_LOCK_S + 5)
    t0 = time.monotonic()
    cpu_kernels._wait_for_build_lock("sy_test_ext")
    assert not lock.exists() and time.monotonic() - t0 < 1.0


def test_fresh_lock_is_waited_for_with_a_deadline(tmp_path, monkeypatch):
    lock = _lock(tmp_path, monkeypatch, age_s=0)
    monkeypatch.setattr(cpu_kernels, "STALE_LOCK_S", 0.6)
    t0 = time.monotonic()
    cpu_kernels._wait_for_build_lock("sy_test_ext")
    assert not lock.exists() and 0.5 <= time.monotonic() - t0 < 3.0


def test_kernel_name_follows_source_and_flags():
    assert cpu_kernels._NAME.startswith("switchyard_cpu_") and len(cpu_kernels._NAME) == 27
