"""The C++ kernel's build never hangs a worker on a lock left by a killed compile."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from worker.kernels import cpu as cpu_kernels


def _lock(tmp_path: Path, monkeypatch, age_s: float) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "sy_test_ext" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_lock_left_by_a_killed_build_is_removed_at_once(tmp_path, monkeypatch):
    """No live builder holds the builder lock: torch's lock file, however fresh, is stale."""
    lock = _lock(tmp_path, monkeypatch, age_s=0)
    t0 = time.monotonic()
    with cpu_kernels._build_turn("sy_test_ext"):
        assert not lock.exists()
    assert time.monotonic() - t0 < 1.0


def test_a_live_build_is_waited_for_with_a_deadline(tmp_path, monkeypatch):
    lock = _lock(tmp_path, monkeypatch, age_s=0)
    monkeypatch.setattr(cpu_kernels, "STALE_LOCK_S", 0.6)
    other = os.open(tmp_path / "sy_test_ext.builder", os.O_CREAT | os.O_RDWR)  # a live builder's flock
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        with cpu_kernels._build_turn("sy_test_ext"):
            waited = time.monotonic() - t0
        assert not lock.exists() and 0.5 <= waited < 3.0
    finally:
        os.close(other)


def test_the_builder_lock_passes_to_the_next_build(tmp_path, monkeypatch):
    _lock(tmp_path, monkeypatch, age_s=0)
    other = os.open(tmp_path / "sy_test_ext.builder", os.O_CREAT | os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    threading.Timer(0.3, os.close, (other,)).start()  # the live builder finishes (or dies) after 0.3 s
    t0 = time.monotonic()
    with cpu_kernels._build_turn("sy_test_ext"):
        assert 0.25 <= time.monotonic() - t0 < 2.0


def test_kernel_name_follows_source_and_flags():
    assert cpu_kernels._NAME.startswith("switchyard_cpu_") and len(cpu_kernels._NAME) == 27


def test_a_built_kernel_loads_past_a_lock_left_by_a_killed_load():
    """torch takes its build lock on every load, even with nothing to build: a worker killed then left the
    lock, and the next workers waited for it. A library already built under the kernel's name loads without
    it."""
    from torch.utils.cpp_extension import _get_build_directory

    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (no compiler): nothing to load")
    lock = Path(_get_build_directory(cpu_kernels._NAME, verbose=False)) / "lock"
    lock.touch()  # as if a load was killed holding it
    try:
        t0 = time.monotonic()
        module = cpu_kernels._load_built(cpu_kernels._NAME)
        assert module is not None and hasattr(module, "paged_decode") and time.monotonic() - t0 < 5.0
    finally:
        lock.unlink(missing_ok=True)

