"""Which blocks each worker reports holding: one set of 64-bit block ids per worker (and one of the blocks its
KV tiers hold below memory), kept in step with the numbered batches on its stats stream, and the longest
reported prefix of a prompt on each worker.

Bounded: a worker may index at most its own KV pages (with slack for a late eviction batch) and the whole
index at most `max_blocks` ids; a report past either is dropped and the worker counts as reporting nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from worker.protocol import KvReport

log = logging.getLogger(__name__)

DEFAULT_MAX_TIER_BLOCKS = 1_000_000  # tier-held ids per worker; past it the worker's tier set is dropped
DEFAULT_MAX_BLOCKS = 2_000_000  # about 75 MB per million ids in Python sets (tests/test_router_kv_index.py)
_SLACK = 1.25  # a worker's set may run ahead of its pages by a batch of evictions not yet applied


class Applied(StrEnum):
    """What became of one report."""

    APPLIED = "applied"  # a delta or a snapshot taken in
    CURRENT = "current"  # nothing new (an empty report, or a batch seen before)
    GAP = "gap"  # a batch is missing (or the report was unreadable): ask the worker for a snapshot
    OVERFLOW = "overflow"  # over the worker's or the index's bound: dropped, ask for a snapshot


@dataclass(slots=True)
class _Blocks:
    epoch: int = -1
    seq: int = 0
    synced: bool = False  # a snapshot (or the worker's first batch) has been taken in
    ids: set[int] = field(default_factory=set)
    tiered: set[int] = field(default_factory=set)  # held in a KV tier below memory (restored on a hit)


class KvIndex:
    """Block ids per worker; all calls are synchronous and O(size of the report) or O(prompt blocks)."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 max_tier_blocks: int = DEFAULT_MAX_TIER_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be > 0")
        self.max_blocks = max_blocks
        self.max_tier_blocks = max_tier_blocks
        self._workers: dict[str, _Blocks] = {}
        self._total = 0

    @property
    def total_blocks(self) -> int:
        return self._total

    def blocks(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return len(w.ids) if w is not None else 0

    def synced(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.synced

    def apply(self, worker_id: str, report: KvReport, capacity_blocks: int) -> Applied:
        """Take in one report from `worker_id`, which holds at most `capacity_blocks` pages."""
        w = self._workers.setdefault(worker_id, _Blocks())
        if report.epoch != w.epoch:  # a new worker process: it starts empty and numbers from 1
            self._reset(w, report.epoch)
        if report.snapshot:
            if report.seq < w.seq:
                return Applied.CURRENT  # older than what we have (a delayed snapshot)
            self._set(w, set())
            w.tiered = set()
            w.seq, w.synced = report.seq, True
            self._tier(w, report)
            return self._add(w, report.stored, capacity_blocks)
        if not report.stored and not report.evicted and not report.tiered and not report.untiered:
            return Applied.CURRENT if report.seq <= w.seq else self._gap(w, True)
        if report.seq <= w.seq:
            return Applied.CURRENT
        if report.seq != w.seq + 1 or not w.synced and w.seq != 0:
            return self._gap(w, True)
        w.seq, w.synced = report.seq, True
        self._tier(w, report)
        before = len(w.ids)
        w.ids.difference_update(report.evicted)
        self._total -= before - len(w.ids)
        return self._add(w, report.stored, capacity_blocks)

    def corrupt(self, worker_id: str) -> Applied:
        """The worker's last report could not be read: its view is stale until a snapshot."""
        w = self._workers.setdefault(worker_id, _Blocks())
        return self._gap(w, True)

    def forget(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._total -= len(w.ids)

    def match_tiered(self, ids: list[int], workers: Iterable[str]) -> dict[str, tuple[int, int]]:
        """For each of `workers` holding the prompt's first block in memory or a tier: (leading blocks of
        `ids` in memory, the blocks after those that memory or a tier holds)."""
        out: dict[str, tuple[int, int]] = {}
        if not ids:
            return out
        first = ids[0]
        for wid in workers:
            w = self._workers.get(wid)
            if w is None or (first not in w.ids and first not in w.tiered):
                continue
            held, tiered, n = w.ids, w.tiered, 0
            while n < len(ids) and ids[n] in held:
                n += 1
            m = n
            while m < len(ids) and (ids[m] in tiered or ids[m] in held):
                m += 1
            out[wid] = (n, m - n)
        return out

    def match(self, ids: list[int], workers: Iterable[str]) -> dict[str, int]:
        """For each of `workers` holding the prompt's first block, how
        many leading blocks of `ids` it holds."""
        out: dict[str, int] = {}
        if not ids:
            return out
        first = ids[0]
        for wid in workers:
            w = self._workers.get(wid)
            if w is None or first not in w.ids:
                continue
            held, n = w.ids, 1
            while n < len(ids) and ids[n] in held:
                n += 1
            out[wid] = n
        return out

    # ------------------------------------------------------------ internals

    def _add(self, w: _Blocks, stored: list[int], capacity_blocks: int) -> Applied:
        bound = capacity_blocks * _SLACK + 64
        # over a bound however many repeat: take nothing
        if len(stored) > bound or len(stored) > self.max_blocks:
            self._set(w, set())
            w.synced = False
            return Applied.OVERFLOW
        new = set(stored).difference(w.ids)  # checked against both bounds before any of it is taken in
        if len(w.ids) + len(new) > bound or self._total + len(new) > self.max_blocks:
            self._set(w, set())
            w.synced = False
            return Applied.OVERFLOW
        w.ids.update(new)
        self._total += len(new)
        return Applied.APPLIED

    def _tier(self, w: _Blocks, report: KvReport) -> None:
        w.tiered.difference_update(report.untiered)
        w.tiered.update(report.tiered)
        if len(w.tiered) > self.max_tier_blocks:
            w.tiered = set()  # over the bound: this worker's tiers get no credit until its next snapshot

    def _gap(self, w: _Blocks, stale: bool) -> Applied:
        w.synced = w.synced and not stale
        return Applied.GAP

    def _reset(self, w: _Blocks, epoch: int) -> None:
        self._set(w, set())
        w.tiered = set()
        w.epoch, w.seq, w.synced = epoch, 0, False

    def _set(self, w: _Blocks, ids: set[int]) -> None:
        self._total += len(ids) - len(w.ids)
        w.ids = ids
