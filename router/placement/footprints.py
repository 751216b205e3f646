"""Each worker's footprint as its own reports show it: blocks it stored, each weighted by exp(-blocks stored
anywhere since / the cluster's KV blocks), so every replica fed the same reports sees the same footprints.
"""

from __future__ import annotations

import math


class ReportedFootprints:
    def __init__(self) -> None:
        self._tokens: dict[str, float] = {}  # decayed to `_at[worker]`
        self._at: dict[str, float] = {}
        self._capacity: dict[str, int] = {}
        self._placed = 0.0  # the clock: tokens stored anywhere

    def stored(self, worker_id: str, tokens: int, capacity: int) -> None:
        """`worker_id` (of `capacity` KV tokens) reports `tokens` newly stored."""
        self._capacity[worker_id] = capacity
        if tokens <= 0:
            return
        self._placed += tokens
        self._tokens[worker_id] = self._decayed(worker_id) + tokens
        self._at[worker_id] = self._placed

    def forget(self, worker_id: str) -> None:
        for table in (self._tokens, self._at, self._capacity):
            table.pop(worker_id, None)

    def footprints(self) -> dict[str, float]:
        return {w: self._decayed(w) for w in self._tokens}

    def _decayed(self, worker_id: str) -> float:
        scale = sum(self._capacity.values())
        tokens = self._tokens.get(worker_id, 0.0)
        if scale <= 0 or not tokens:
            return tokens
        return tokens * math.exp(-(self._placed - self._at.get(worker_id, self._placed)) / scale)
