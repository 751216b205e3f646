"""The workers' own reports of the blocks they hold, as routing sees them: the kv handshake (a worker whose
block-hash contract differs is refused), the index kept in step with each stats frame, snapshots asked for on
a gap, and each worker's longest cached prefix of a prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from router.placement import routing_metrics
from router.placement.footprints import ReportedFootprints
from router.placement.kv_index import DEFAULT_MAX_BLOCKS, Applied, KvIndex
from router.placement.prefix import token_count
from worker.protocol import HASH_ALGO, KvContract, WorkerStats, block_ids

log = logging.getLogger(__name__)

SYNC_RETRY_S = 0.5  # at most one snapshot request per worker in this interval
MAX_INDEX_BLOCKS = 4096  # prompt blocks looked up at most (64k tokens at block size 16)
# A block a worker holds only in a KV tier below memory counts this much of a block in memory: restoring it is
# far cheaper than a prefill (docs/engine.md "KV tiers") but not free, and it may sit on disk; so of two
# workers with the same prefix, the one holding it in memory wins.
TIER_CREDIT = 0.5


class KvView:
    def __init__(self, *, block_size: int, tokenizer_version: str | None, request_sync: Callable[[str], None],
                 clock: Callable[[], float], max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.block_size = block_size
        self.tokenizer_version = tokenizer_version  # None: not compared (a router without a served model)
        self.index = KvIndex(max_blocks)
        self.footprints = ReportedFootprints()
        self._request_sync = request_sync
        self._clock = clock
        self._refused: dict[str, str] = {}  # worker -> the contract field that differs
        self._asked_at: dict[str, float] = {}

    @property
    def active(self) -> bool:
        """Some worker reports its blocks (else look-ups are skipped)."""
        return self.index.total_blocks > 0

    def refused(self, worker_id: str) -> bool:
        return worker_id in self._refused

    def observe(self, worker_id: str, stats: WorkerStats) -> None:
        """Check the frame's contract and take in its block report; ask for a snapshot on a gap."""
        if stats.kv_error:
            log.warning("unreadable block report from worker %s (%s): asking for a snapshot", worker_id,
                        stats.kv_error)
            self.index.corrupt(worker_id)
            self._sync(worker_id, "corrupt", force=True)
            return
        kv = stats.kv
        if kv is None:
            return
        if not self._accept(worker_id, kv.contract):
            return
        outcome = self.index.apply(worker_id, kv, max(1, stats.kv_total // self.block_size))
        if outcome is Applied.APPLIED and not kv.snapshot:
            self.footprints.stored(worker_id, len(kv.stored) * self.block_size, stats.kv_total)
        routing_metrics.KV_INDEX_BLOCKS.labels(worker_id).set(self.index.blocks(worker_id))
        if outcome in (Applied.GAP, Applied.OVERFLOW):
            self._sync(worker_id, outcome.value, force=True)
        elif not self.index.synced(worker_id):
            self._sync(worker_id, "stale")

    def forget(self, worker_id: str) -> None:
        self.index.forget(worker_id)
        self.footprints.forget(worker_id)
        self._refused.pop(worker_id, None)
        self._asked_at.pop(worker_id, None)

    def matched(self, ns: bytes, tokens: Sequence[int] | np.ndarray | bytes,
                workers: Iterable[str]) -> dict[str, int]:
        """Prompt tokens each worker reports holding as a prefix of `tokens` (only those holding some); blocks
        held only in a worker's KV tiers count TIER_CREDIT of a token each."""
        if not self.active:
            return {}
        bs = self.block_size
        n_tokens = token_count(tokens)
        # a worker's own match leaves out the prompt's last token (it must compute one position)
        ids = block_ids(ns, tokens, bs, min((n_tokens - 1) // bs, MAX_INDEX_BLOCKS))
        out = {w: n * bs + int(TIER_CREDIT * t * bs)
               for w, (n, t) in self.index.match_tiered(ids, workers).items()}
        return {w: n for w, n in out.items() if n > 0}

    # ------------------------------------------------------------ internals

    def _accept(self, worker_id: str, contract: KvContract) -> bool:
        why = self._mismatch(contract)
        was = self._refused.get(worker_id)
        if why is None:
            if was is not None:
                log.info("worker %s now reports a matching block-hash contract: accepted", worker_id)
                del self._refused[worker_id]
            return True
        if was != why:
            self._refused[worker_id] = why
            self.index.forget(worker_id)
            routing_metrics.REFUSED.labels(why).inc()
            log.error("refusing worker %s: its block-hash contract differs in %s (worker: block_size=%d "
                      "hash=%s tokenizer=%s; this gateway: block_size=%d hash=%s tokenizer=%s); it gets no "
                      "requests",
                      worker_id, why, contract.block_size, contract.hash_algo, contract.tokenizer,
                      self.block_size, HASH_ALGO, self.tokenizer_version)
        return False

    def _mismatch(self, c: KvContract) -> str | None:
        if c.block_size != self.block_size:
            return "block_size"
        if c.hash_algo != HASH_ALGO:
            return "hash"
        if self.tokenizer_version is not None and c.tokenizer != self.tokenizer_version:
            return "tokenizer"
        return None

    def _sync(self, worker_id: str, reason: str, force: bool = False) -> None:
        now = self._clock()
        last = self._asked_at.get(worker_id)
        if last is not None and now - last < (SYNC_RETRY_S / 5 if force else SYNC_RETRY_S):
            return
        self._asked_at[worker_id] = now
        routing_metrics.KV_SYNCS.labels(reason).inc()
        self._request_sync(worker_id)


def beyond_common(matched: dict[str, int], members: Iterable[str]) -> dict[str, int]:
    """Reported prefix tokens beyond what every member holds (a chat template's common opening is no reason
    to prefer anyone); empty when no worker holds more than the others."""
    if not matched:
        return {}
    members = tuple(members)
    floor = min(matched.get(w, 0) for w in members)
    return {w: matched[w] - floor for w in members if matched.get(w, 0) > floor}
