"""Keep a worker's resident memory flat: bounded oneDNN/ideep kernel caches (set before the first matmul),
glibc arenas capped and trimmed (`malloc_trim`) on a schedule, and an opt-in memory report for diagnosis.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

# SWITCHYARD_MALLOC_TRIM_S overrides it (the CI soak trims every 5 s for a smoother series)
TRIM_INTERVAL_S = 30.0
TRIM_ENV = "SWITCHYARD_MALLOC_TRIM_S"
# bf16 matmuls run through oneDNN: every distinct shape (a step's row count varies from 1 to
# max_num_batched_tokens) gets a JIT'd primitive of 0.65-1 MB, kept by ideep's cache and oneDNN's, 1,024
# entries each by default: up to ~700 MB that creeps in as new step sizes appear. 256 bounds it near 230 MB;
# a miss re-creates the primitive (about 2 ms here), it never changes a result. An operator's setting wins.
KERNEL_CACHE_CAPACITY = 256
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# glibc gives each thread that allocates its own arena (up to 8 per core); the soak's worker kept 120-150 MB
# free in them between trims (RSS swinging by ~100 MB), against 8-20 MB with two.
ARENA_MAX = 2
M_ARENA_MAX = -8  # mallopt parameter number, from glibc's malloc.h
log = logging.getLogger(__name__)
REPORT_ENV, REPORT_INTERVAL_ENV = "SWITCHYARD_MEMORY_REPORT", "SWITCHYARD_MEMORY_REPORT_S"


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)
_MALLOPT = getattr(_LIBC, "mallopt", None)


def bound_native_memory() -> dict[str, str]:
    """Called at worker start, before torch runs a matmul: cap the kernel caches and glibc's arenas (no-op
    where the C library has no mallopt). Returns the cache settings in force (also logged)."""
    for name in KERNEL_CACHE_ENV:
        os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))
    if _MALLOPT is not None and "MALLOC_ARENA_MAX" not in os.environ:
        _MALLOPT(M_ARENA_MAX, ARENA_MAX)
    caches = {name: os.environ[name] for name in KERNEL_CACHE_ENV}
    log.info("kernel caches %s, malloc arenas %s", caches, os.environ.get("MALLOC_ARENA_MAX", ARENA_MAX))
    return caches


class TrimSchedule:
    """Calls `malloc_trim(0)` when `maybe_trim(now)` finds the interval has passed."""

    def __init__(self, interval: float | None = None) -> None:
        self.interval = interval if interval is not None else float(os.environ.get(TRIM_ENV, TRIM_INTERVAL_S))
        self._next = 0.0
        self.trims = 0

    @property
    def available(self) -> bool:
        return _MALLOC_TRIM is not None

    def maybe_trim(self, now: float) -> bool:
        if _MALLOC_TRIM is None or now < self._next:
            return False
        self._next = now + self.interval
        _MALLOC_TRIM(0)
        self.trims += 1
        return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def rss_mb(pid: int | str = "self", field: str = "VmRSS") -> float:
    """Resident MB of a process from /proc: VmRSS (all), RssAnon (heap, stacks, JIT code) or RssFile (mapped
    files, such as the pages of libtorch that the code paths run so far have touched)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def heap_mb() -> dict[str, float]:
    """glibc's view: bytes in use, free inside the arenas, and in mmapped chunks (empty without mallinfo2)."""
    fn = getattr(_LIBC, "mallinfo2", None)
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    mi = fn()
    return {"heap_used": mi.uordblks / 2**20, "heap_free": mi.fordblks / 2**20,
            "heap_mmap": mi.hblkhd / 2**20}


class MemoryReport:
    """Debug only, off unless SWITCHYARD_MEMORY_REPORT names a file ("{pid}" in it: this process id): every
    SWITCHYARD_MEMORY_REPORT_S seconds (default 10) append one JSON line with RSS, glibc heap figures, the
    traced Python heap and the ten source lines whose Python allocations grew most since the first report
    (tracemalloc, 1 frame)."""

    def __init__(self, path: str | None = None, interval: float | None = None) -> None:
        path = path if path is not None else os.environ.get(REPORT_ENV) or None
        self.path = path.replace("{pid}", str(os.getpid())) if path else None
        self.interval = interval if interval is not None else float(os.environ.get(REPORT_INTERVAL_ENV, "10"))
        self._next = 0.0
        self._base: tracemalloc.Snapshot | None = None
        self._started = time.monotonic()
        if self.path:
            tracemalloc.start(1)

    def maybe_report(self, now: float) -> None:
        if not self.path or now < self._next:
            return
        self._next = now + self.interval
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        if self._base is None:
            self._base = snap
        top = snap.compare_to(self._base, "lineno")[:10]
        line = {"t": round(now - self._started, 1), "rss": rss_mb(), "anon": rss_mb(field="RssAnon"),
                "file": rss_mb(field="RssFile"), **heap_mb(),
                "py_traced": tracemalloc.get_traced_memory()[0] / 2**20,
                "py_growth": [[str(s.traceback[0]), s.size_diff, s.count_diff] for s in top]}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self.path and tracemalloc.is_tracing():
            tracemalloc.stop()
