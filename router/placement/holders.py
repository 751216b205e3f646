"""Which worker holds which prompt prefix, as this gateway learned
from its own traffic, and each worker's footprint.

Footprints decay as new prefixes come in (scale: the cluster's KV
tokens), so they follow the working set, not history.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

HIT_MEMORY = 16384  # prefix keys whose holders are remembered


@dataclass(slots=True)
class _Held:
    tokens: int
    used_at: float  # placement clock at its last use


@dataclass(slots=True)
class _Footprint:
    tokens: float = 0.0  # decayed to `at`
    at: float = 0.0


class PrefixHolders:
    """Prefix key -> {worker: tokens held}, bounded, with per-worker decayed footprints."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, dict[str, _Held]] = OrderedDict()  # most recently used last
        self._footprints: dict[str, _Footprint] = {}
        self._capacity: dict[str, int] = {}  # worker -> KV tokens it reported
        self._scale = 0  # sum of _capacity: the decay's scale
        self._placed = 0.0  # the clock: prefix tokens placed where they were not held

    def expected_cached(self, worker_id: str, key: bytes | None) -> int:
        """Prompt tokens of prefix `key` that `worker_id` is expected to hold (0 if unknown)."""
        held = self._keys.get(key) if key is not None else None
        entry = held.get(worker_id) if held else None
        return entry.tokens if entry is not None else 0

    def held(self, key: bytes | None) -> dict[str, int]:
        """Every worker expected to hold prefix `key`, with the prompt tokens it holds."""
        held = self._keys.get(key) if key is not None else None
        return {wid: entry.tokens for wid, entry in held.items()} if held else {}

    def remember(self, worker_id: str, key: bytes | None, tokens: int) -> None:
        """`worker_id` now holds `tokens` prompt tokens under prefix `key` (it prefilled or hit them)."""
        if key is None or tokens <= 0:
            return
        held = self._keys.pop(key, None) or {}
        prev = held.get(worker_id)
        if prev is None:
            self._placed += tokens
        else:
            self._add(worker_id, -prev.tokens, prev.used_at)
        self._add(worker_id, tokens, self._placed)
        held[worker_id] = _Held(tokens, self._placed)
        self._keys[key] = held
        if len(self._keys) > HIT_MEMORY:
            _, dropped = self._keys.popitem(last=False)
            for wid, entry in dropped.items():
                self._add(wid, -entry.tokens, entry.used_at)

    def footprints(self) -> dict[str, float]:
        """Each worker's remembered prefix tokens, weighted by how recently each prefix was used."""
        return {wid: self._decayed(fp) for wid, fp in self._footprints.items()}

    def set_capacity(self, worker_id: str, kv_tokens: int) -> None:
        self._scale += kv_tokens - self._capacity.get(worker_id, 0)
        self._capacity[worker_id] = kv_tokens

    def capacity(self, worker_id: str) -> int:
        return self._capacity.get(worker_id, 0)

    def forget(self, worker_id: str) -> None:
        """A worker left: it holds nothing any more."""
        for held in self._keys.values():
            held.pop(worker_id, None)
        self._footprints.pop(worker_id, None)
        self._scale -= self._capacity.pop(worker_id, 0)

    def clear(self) -> None:
        """Drop what is known of which worker holds which prefix (the membership changed)."""
        self._keys.clear()
        self._footprints.clear()

    def _add(self, worker_id: str, tokens: int, used_at: float) -> None:
        fp = self._footprints.setdefault(worker_id, _Footprint(0.0, self._placed))
        fp.tokens = max(0.0, self._decayed(fp) + tokens * self._weight(used_at))
        fp.at = self._placed

    def _decayed(self, fp: _Footprint) -> float:
        return fp.tokens * self._weight(fp.at)

    def _weight(self, used_at: float) -> float:
        return math.exp(-(self._placed - used_at) / self._scale) if self._scale > 0 else 1.0


class InFlightPrefixes:
    """Prefix keys of this gateway's requests in flight, per worker:
    what a worker will hold before it reports it."""

    def __init__(self) -> None:
        self._keys: dict[bytes, dict[str, list[int]]] = {}  # key -> worker -> [requests, tokens]

    def add(self, key: bytes | None, worker_id: str, tokens: int) -> None:
        if key is None or tokens <= 0:
            return
        entry = self._keys.setdefault(key, {}).setdefault(worker_id, [0, 0])
        entry[0] += 1
        entry[1] = max(entry[1], tokens)

    def remove(self, key: bytes | None, worker_id: str) -> None:
        workers = self._keys.get(key) if key is not None else None
        entry = workers.get(worker_id) if workers else None
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del workers[worker_id]
            if not workers:
                del self._keys[key]

    def held(self, key: bytes | None) -> dict[str, int]:
        workers = self._keys.get(key) if key is not None else None
        return {w: entry[1] for w, entry in workers.items()} if workers else {}
