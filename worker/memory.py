"""Hand freed heap memory back to the operating system, so a worker's RSS follows what it uses.

A worker allocates and frees many short-lived buffers of varied sizes (prompt tensors,
token lists, protocol frames). glibc's allocator keeps freed chunks in its arenas and
returns them to the OS only from the top of each heap, so a long-running worker's RSS
can creep upward through fragmentation even when nothing is leaked. `malloc_trim(0)`
releases the free pages inside every arena. `TrimSchedule` calls it at most once per
interval from the server loop's housekeeping; on a C library without `malloc_trim`
(musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

TRIM_INTERVAL_S = 30.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


class TrimSchedule:
    """Calls `malloc_trim(0)` when `maybe_trim(now)` finds the interval has passed."""

    def __init__(self, interval: float = TRIM_INTERVAL_S) -> None:
        self.interval = interval
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
