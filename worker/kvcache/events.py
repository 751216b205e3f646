"""The radix cache's log of stored and evicted block ids (and of blocks entering and leaving the KV tiers
below it), cut into numbered batches for the stats stream.

Each id is in at most one of the pending sets (its last change wins), so a batch applies in any order; a log
that grows past its bound is dropped and the next batch is a full snapshot instead.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from worker.protocol import HASH_ALGO, KvContract, KvReport, block_ids


@dataclass(slots=True)
class KvBatch:
    """One numbered change to what a worker holds: a delta, or (`snapshot`) everything it holds."""

    epoch: int  # random per worker process: a restarted worker's numbers start over
    seq: int  # the last delta this batch includes
    snapshot: bool
    stored: list[int]
    evicted: list[int]
    tiered: list[int] = field(default_factory=list)  # now held in a tier below memory (snapshot: all of them)
    untiered: list[int] = field(default_factory=list)  # no longer held in any tier


class KvEvents:
    """Pending changes since the last batch. `max_pending` bounds them; beyond it the log asks for a
    snapshot."""

    def __init__(self, max_pending: int) -> None:
        if max_pending <= 0:
            raise ValueError("max_pending must be > 0")
        self.max_pending = max_pending
        self.epoch = secrets.randbits(63)
        self.seq = 0
        self._stored: set[int] = set()
        self._evicted: set[int] = set()
        self._tiered: set[int] = set()
        self._untiered: set[int] = set()
        self._overflow = False
        # set by `worker.kvcache.tiers.tier_store.KvTiers`
        self.tier_held: Callable[[], list[int]] | None = None
        # set by the vLLM-format publisher (worker.server.process.kv_publisher): `kv_report` hands it each
        # batch (None: no change) and a way to take a snapshot
        self.on_batch: Callable[[KvBatch | None, Callable[[], KvBatch]], None] | None = None

    @property
    def pending(self) -> int:
        return len(self._stored) + len(self._evicted) + len(self._tiered) + len(self._untiered)

    def stored(self, ids: Iterable[int]) -> None:
        if self._overflow:
            return
        for i in ids:
            self._evicted.discard(i)
            self._stored.add(i)
        self._check_bound()

    def evicted(self, ids: Iterable[int]) -> None:
        if self._overflow:
            return
        for i in ids:
            self._stored.discard(i)
            self._evicted.add(i)
        self._check_bound()

    def tier_changes(self, stored: Iterable[int], dropped: Iterable[int]) -> None:
        if self._overflow:
            return
        for i in dropped:
            self._tiered.discard(i)
            self._untiered.add(i)
        for i in stored:
            self._untiered.discard(i)
            self._tiered.add(i)
        self._check_bound()

    def next_batch(self, held: Callable[[], list[int]]) -> KvBatch | None:
        """The pending changes as batch `seq + 1` (None when there are none); after an overflow, a snapshot
        of `held()` under that number, so every gateway replaces its view."""
        if self._overflow:
            self._overflow = False
            self.seq += 1
            return self._snapshot(held)
        if not self.pending:
            return None
        self.seq += 1
        batch = KvBatch(self.epoch, self.seq, False, list(self._stored), list(self._evicted),
                        list(self._tiered), list(self._untiered))
        self._stored, self._evicted, self._tiered, self._untiered = set(), set(), set(), set()
        return batch

    def snapshot(self, held: Callable[[], list[int]]) -> KvBatch:
        """Everything held now, numbered with the last batch sent: later batches apply on top of it (pending
        changes are already in the tree, and applying one twice changes nothing)."""
        return self._snapshot(held)

    def _snapshot(self, held: Callable[[], list[int]]) -> KvBatch:
        return KvBatch(self.epoch, self.seq, True, held(), [], self.tier_held() if self.tier_held else [])

    def _check_bound(self) -> None:
        if self.pending > self.max_pending:
            self._stored, self._evicted, self._overflow = set(), set(), True
            self._tiered, self._untiered = set(), set()


class RadixCacheLike(Protocol):
    events: KvEvents

    def held_block_ids(self) -> list[int]: ...

    def peek(self, ns: bytes, tokens: Sequence[int]) -> int: ...


def kv_report(cache: RadixCacheLike | None, block_size: int, tokenizer_version: str,
              snapshot: bool = False) -> KvReport | None:
    """The `kv` part of the next stats frame: the next batch (or, `snapshot`, everything held), or with no
    changes an empty report under the last number (a gateway that missed a batch sees the gap)."""
    if cache is None:
        return None
    events = cache.events
    batch = events.snapshot(cache.held_block_ids) if snapshot else events.next_batch(cache.held_block_ids)
    if not snapshot and events.on_batch is not None:
        events.on_batch(batch, lambda: events.snapshot(cache.held_block_ids))
    if batch is None:
        batch = KvBatch(events.epoch, events.seq, False, [], [])
    return KvReport(KvContract(block_size, HASH_ALGO, tokenizer_version), batch.epoch, batch.seq,
                    batch.snapshot, batch.stored, batch.evicted, batch.tiered, batch.untiered)


class KvPromises:
    """Blocks a worker is about to compute, reported as stored when their request is admitted, so that every
    gateway learns a placement at once rather than after the prefill. When the request ends, a promised block
    the tree does not hold (and no open promise still covers) is reported evicted."""

    def __init__(self, cache: RadixCacheLike, block_size: int) -> None:
        self._cache = cache
        self._bs = block_size
        self._open: dict[str, tuple[bytes, Sequence[int], list[int]]] = {}  # rid -> (ns, tokens, ids)
        self._refs: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    def promise(self, rid: str, ns: bytes, tokens: Sequence[int]) -> None:
        n_blocks = (len(tokens) - 1) // self._bs  # the worker computes at least the last prompt token
        if not ns or n_blocks <= 0 or rid in self._open:
            return
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # ints, as the tree keys them
        ids = block_ids(ns, tokens, self._bs, n_blocks)
        self._open[rid] = (ns, tokens, ids)
        for i in ids:
            self._refs[i] = self._refs.get(i, 0) + 1
        self._cache.events.stored(ids)

    def settle(self, alive: Callable[[str], bool]) -> None:
        """Close the promises of requests that ended; withdraw the blocks nothing holds."""
        for rid in [r for r in self._open if not alive(r)]:
            ns, tokens, ids = self._open.pop(rid)
            held = self._cache.peek(ns, tokens[: len(ids) * self._bs]) // self._bs
            gone = []
            for k, i in enumerate(ids):
                left = self._refs[i] - 1
                if left:
                    self._refs[i] = left
                else:
                    del self._refs[i]
                    if k >= held:
                        gone.append(i)
            if gone:
                self._cache.events.evicted(gone)
