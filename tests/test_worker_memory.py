"""TrimSchedule: glibc's malloc_trim is found on Linux and called at most once per interval."""

from __future__ import annotations

from worker.memory import TrimSchedule


def test_trims_at_most_once_per_interval() -> None:
    trim = TrimSchedule(interval=30.0)
    assert trim.available  # glibc on the Linux machines this project runs on
    assert trim.maybe_trim(100.0)
    assert not trim.maybe_trim(110.0)
    assert trim.maybe_trim(130.0)
    assert trim.trims == 2
