"""Cached prefixes held for requests that wait (pages a prefill worker pushed): not evictable until the
scheduler admits the request, which then holds them under its own match, or the request ends."""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.records.sequence import ScheduledBatch
from worker.kvcache.radix_cache import RadixCache, RadixNode


class PrefixPins:
    """One radix-cache lock per pinned request id, released exactly once."""

    def __init__(self, cache: RadixCache | None) -> None:
        self.cache = cache
        self._held: dict[str, RadixNode] = {}

    def __len__(self) -> int:
        return len(self._held)

    def pin(self, rid: str, namespace: bytes, tokens: Sequence[int]) -> int:
        """Lock the cached pages of `tokens` for request `rid` (at most one pin each); the tokens held."""
        if self.cache is None or not tokens or rid in self._held:
            return 0
        handle, held = self.cache.lock_prefix(namespace, tokens)
        if handle is not None:
            self._held[rid] = handle
        return held

    def release(self, rid: str) -> None:
        handle = self._held.pop(rid, None)
        if handle is not None:
            assert self.cache is not None
            self.cache.unlock(handle)

    def admitted(self, batch: ScheduledBatch) -> None:
        """The step's prefills matched their prefixes under their own locks: theirs replace the pins."""
        for seq, _ in batch.prefills:
            self.release(seq.rid)
