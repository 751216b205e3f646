"""vLLM-format KV event batches from one source (a vLLM server or a Switchyard worker) taken into the
router's index of reported blocks (`KvIndex`), in sequence order, under Switchyard's tenant-salted block ids.

A Switchyard worker's block hashes are already those ids. A vLLM server's are rekeyed: a chain that starts at
a prompt's first block carries vLLM's `cache_salt` in its first block's extra keys; when that salt is the hex
of a tenant's namespace root, the router chains the event's token ids from it exactly as a Switchyard worker
would (`worker.protocol.chain`) and remembers each vLLM hash's digest (bounded) so later blocks chain on.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from router.placement.kv_index import Applied, KvIndex
from router.placement.routing_metrics import KV_INDEX_BLOCKS
from worker.protocol import KvContract, KvReport, block_id, chain
from worker.protocol.vllm_events import AllBlocksCleared, BlockStored, KvEvent, decode_batch, hash_id

log = logging.getLogger(__name__)

_SALT = re.compile(r"^[0-9a-f]{32}$")  # a namespace root (16 bytes) in hex
_MEMORY = (None, "GPU", "gpu")


@dataclass(slots=True)
class FeedSource:
    """One publisher the router subscribes to."""

    worker_id: str  # the id its blocks are indexed under
    endpoint: str  # its PUB socket
    replay_endpoint: str | None = None  # its replay ROUTER; None: a gap clears its view instead
    hashes: Literal["vllm", "switchyard"] = "vllm"  # switchyard: block hashes are Switchyard block ids
    topic: str = ""  # subscription prefix
    capacity_blocks: int = 1_000_000  # blocks it may hold (KvIndex's per-worker bound)


class Outcome(StrEnum):
    APPLIED = "applied"
    STALE = "stale"  # a batch seen before (a replayed duplicate)
    GAP = "gap"  # a batch is missing: replay from `next_seq`


@dataclass(slots=True)
class _Accum:
    cleared: bool = False
    stored: dict[int, None] = field(default_factory=dict)  # ordered sets
    evicted: dict[int, None] = field(default_factory=dict)
    tiered: dict[int, None] = field(default_factory=dict)
    untiered: dict[int, None] = field(default_factory=dict)

    def put(self, ids: list[int], into: dict[int, None], out_of: dict[int, None]) -> None:
        for i in ids:
            out_of.pop(i, None)
            into[i] = None


class KvIngest:
    """One source's batches into `index`; every call is synchronous and O(the batch)."""

    def __init__(self, source: FeedSource, index: KvIndex, block_size: int,
                 max_keys: int = 1_000_000) -> None:
        self.source = source
        self.index = index
        self.block_size = block_size
        self.max_keys = max_keys
        self.next_seq: int | None = None  # None: nothing taken in yet
        self.counts: Counter[str] = Counter()  # what was dropped or repaired, by reason
        self._epoch = secrets.randbits(63)
        self._n = 0  # the KvReport numbers this ingest gives KvIndex
        self._resync = True  # the next report replaces the source's view
        self._keys: dict[int, tuple[bytes, bytes]] = {}  # vLLM hash -> (namespace, Switchyard digest)

    def restart(self) -> None:
        """The publisher restarted (its numbers went back) or cannot fill a gap: its view starts over."""
        self._epoch = secrets.randbits(63)
        self._n, self._resync, self.next_seq = 0, True, None
        self._keys.clear()

    def resync_at(self, seq: int) -> None:
        """Missed batches cannot be had: continue at `seq`, the next report replacing the view."""
        self.counts["resync"] += 1
        self._resync, self.next_seq = True, seq

    def offer(self, seq: int, payload: bytes, replayed: bool = False) -> Outcome:
        """Batch `seq`: applied when it is the next one (or the first seen at 0), else a gap or stale."""
        if self.next_seq is None:
            if seq != 0:
                self.next_seq = 0
                return Outcome.GAP
            self.next_seq = 0
        if seq < self.next_seq:
            if replayed:
                return Outcome.STALE
            log.info("kv events from %s: sequence went back to %d: the publisher restarted",
                     self.source.worker_id, seq)
            self.counts["restart"] += 1
            self.restart()
            self.next_seq = seq
        if seq > self.next_seq:
            self.counts["gap"] += 1
            return Outcome.GAP
        self.next_seq = seq + 1
        self._apply(payload)
        return Outcome.APPLIED

    # ------------------------------------------------------------ internals

    def _apply(self, payload: bytes) -> None:
        try:
            _, events, bad = decode_batch(payload)
        except ValueError as exc:
            self.counts["undecodable"] += 1
            log.warning("kv events from %s: unreadable batch dropped (%s)", self.source.worker_id, exc)
            return
        for tag in bad:
            self.counts[f"unknown:{tag}"] += 1
        if bad:
            log.warning("kv events from %s: %d events skipped (tags %s)", self.source.worker_id, len(bad),
                        sorted(set(bad))[:8])
        acc = _Accum()
        for ev in events:
            self._event(ev, acc)
        self._report(acc)

    def _event(self, ev: KvEvent, acc: _Accum) -> None:
        if isinstance(ev, AllBlocksCleared):
            acc.cleared = True
            acc.stored, acc.evicted, acc.tiered, acc.untiered = {}, {}, {}, {}
            self._keys.clear()
            return
        memory = ev.medium in _MEMORY
        if isinstance(ev, BlockStored):
            ids = self._stored_ids(ev)
            acc.put(ids, *((acc.stored, acc.evicted) if memory else (acc.tiered, acc.untiered)))
            return
        ids = self._removed_ids(ev.block_hashes, memory)
        acc.put(ids, *((acc.evicted, acc.stored) if memory else (acc.untiered, acc.tiered)))

    def _stored_ids(self, ev: BlockStored) -> list[int]:
        if self.source.hashes == "switchyard":
            return [hash_id(h) for h in ev.block_hashes]
        if ev.block_size != self.block_size:
            self.counts["block_size"] += 1
            return []
        if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
            self.counts["no_tokens"] += 1
            return []
        root = self._root(ev)
        if root is None:
            return []
        ns, parent = root
        n = self._plain_blocks(ev)
        digests = chain(ns, parent, ev.token_ids, self.block_size, n)
        for h, d in zip(ev.block_hashes, digests, strict=False):
            self._remember(hash_id(h), ns, d)
        return [block_id(d) for d in digests]

    def _root(self, ev: BlockStored) -> tuple[bytes, bytes] | None:
        """(namespace, parent digest) of the event's first block, or None (counted) when unknown."""
        if ev.parent_block_hash is not None:
            known = self._keys.get(hash_id(ev.parent_block_hash))
            if known is None:
                self.counts["orphan"] += 1
            return known
        first = ev.extra_keys[0] if ev.extra_keys else None
        salts = [k for k in first or () if isinstance(k, str) and _SALT.match(k)]
        if len(salts) != 1:
            self.counts["unsalted"] += 1
            return None
        ns = bytes.fromhex(salts[0])
        return ns, ns

    def _plain_blocks(self, ev: BlockStored) -> int:
        """Leading blocks hashed from tokens alone (after the first block's salt): the ones the router can
        rekey; a block with other extra keys (LoRA, images) ends them."""
        extras = ev.extra_keys or []
        for i, keys in enumerate(extras[: len(ev.block_hashes)]):
            rest = [k for k in keys or () if not (i == 0 and isinstance(k, str) and _SALT.match(k))]
            if rest:
                self.counts["extra_keys"] += 1
                return i
        return len(ev.block_hashes)

    def _remember(self, vllm_id: int, ns: bytes, digest: bytes) -> None:
        keys = self._keys
        keys.pop(vllm_id, None)
        keys[vllm_id] = (ns, digest)
        while len(keys) > self.max_keys:
            del keys[next(iter(keys))]  # the oldest: a later block chaining on it counts as an orphan

    def _removed_ids(self, hashes: list[int | bytes], memory: bool) -> list[int]:
        if self.source.hashes == "switchyard":
            return [hash_id(h) for h in hashes]
        out = []
        for h in hashes:
            key = hash_id(h)
            known = self._keys.pop(key, None) if memory else self._keys.get(key)
            if known is None:
                self.counts["unknown_removed"] += 1
            else:
                out.append(block_id(known[1]))
        return out

    def _report(self, acc: _Accum) -> None:
        snapshot = acc.cleared or self._resync
        if not snapshot and not (acc.stored or acc.evicted or acc.tiered or acc.untiered):
            return
        self._n += 1
        self._resync = False
        report = KvReport(KvContract(self.block_size, "", ""), self._epoch, self._n, snapshot,
                          list(acc.stored), [] if snapshot else list(acc.evicted), list(acc.tiered),
                          [] if snapshot else list(acc.untiered))
        worker_id = self.source.worker_id
        outcome = self.index.apply(worker_id, report, self.source.capacity_blocks)
        KV_INDEX_BLOCKS.labels(worker_id).set(self.index.blocks(worker_id))  # as the stats stream's reports
        if outcome is not Applied.APPLIED:
            self.counts[f"index:{outcome.value}"] += 1
            self._resync = True  # over a bound: the next report starts the view over
