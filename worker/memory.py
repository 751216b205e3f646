"""Hand freed heap memory back to the OS (glibc `malloc_trim`), so a worker's RSS follows what it uses.

Fragmentation in glibc's arenas otherwise lets RSS creep up; a no-op on C libraries without it.
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
