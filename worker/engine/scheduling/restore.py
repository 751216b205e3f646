"""Admission's tier step: a prompt's blocks past its radix-cache match that a KV tier holds are loaded into
fresh pages and inserted into the radix cache, so the match that follows counts them as cached.
"""

from __future__ import annotations

import logging
import os
import time

from worker.config import EngineConfig
from worker.engine.records.sequence import ScheduledBatch, Sequence
from worker.kvcache.page_pool import PagePool
from worker.kvcache.radix_cache import RadixCache
from worker.kvcache.tiers import host_budget
from worker.kvcache.tiers.disk import DiskTier
from worker.kvcache.tiers.pages import PageCodec
from worker.kvcache.tiers.tier_store import KvTiers
from worker.protocol import chain

log = logging.getLogger(__name__)


class Restorer:
    def __init__(self, tiers: KvTiers, cache: RadixCache, pool: PagePool, block_size: int) -> None:
        self.tiers = tiers
        self.cache = cache
        self.pool = pool
        self.bs = block_size

    def hashes(self, seq: Sequence) -> list[bytes]:
        """Block digests of seq's whole blocks in `tokens[:-1]` (what admission matches), memoized per
        length."""
        n = len(seq.tokens) - 1
        if seq.block_hashes is None or seq.block_hashes[0] != n:
            seq.block_hashes = (n, chain(seq.namespace, seq.namespace, seq.tokens[:n], self.bs))
        return seq.block_hashes[1]

    def arrived(self, seq: Sequence) -> None:
        """A new request: record its retention and start reading its disk-held blocks while it waits."""
        if self.tiers.disk is None or len(seq.tokens) <= self.bs:
            return
        hashes = self.hashes(seq)
        self.tiers.retain(hashes, seq.sampling.cache_retention)
        self.tiers.prefetch(hashes[self.cache.peek(seq.namespace, seq.tokens[:-1]) // self.bs:])

    def stepped(self, batch: ScheduledBatch, seconds: float) -> None:
        """After a model step: its prefill tokens/s feed the cost model; disk files that went are reported."""
        tokens = sum(n for _, n in batch.prefills)
        if tokens >= 4 * self.bs:  # a short chunk measures step overhead, not prefill
            self.tiers.cost.prefill.add(tokens, seconds)
        self.tiers.settle()

    def restore(self, seq: Sequence) -> int:
        """Load the tier-held blocks after seq's cached prefix when the cost model says so; tokens
        restored."""
        if len(seq.tokens) <= self.bs:
            return 0
        hashes = self.hashes(seq)
        ns, toks, bs = seq.namespace, seq.tokens, self.bs
        held = self.cache.peek(ns, toks[:-1]) // bs
        self.tiers.used(hashes[:held])
        n, ram, disk = self.tiers.available(hashes, held)
        if n == 0:
            return 0
        if not self.tiers.cost.worth(ram, disk, n * bs):
            self.tiers.stats.skipped_by_cost += 1
            return 0
        m = self.cache.match_prefix(ns, toks[: held * bs]) if held else None
        try:
            return self._load(seq, hashes, held, n, m.pages if m else [])
        finally:
            if m is not None:
                self.cache.unlock(m.handle)

    def _load(self, seq: Sequence, hashes: list[bytes], held: int, n: int, prefix: list[int]) -> int:
        """With seq's cached prefix locked (`prefix`: our references to its pages, handed to `insert`)."""
        pool, cache, bs = self.pool, self.cache, self.bs
        need = -(-len(seq.tokens) // bs) - held  # pages the request needs past its cached prefix
        if pool.num_free + cache.evictable_pages < need:
            pool.release(prefix)
            return 0  # it cannot be admitted now: restore when it can
        if pool.num_free < n:
            cache.evict(n - pool.num_free)
        t = time.perf_counter()
        rows = self.tiers.load(hashes[held: held + n])
        n = min(len(rows), pool.num_free)
        if n == 0:
            pool.release(prefix)
            return 0
        pages = pool.allocate(n)
        self.tiers.codec.write(pages, rows[:n])
        cache.insert(seq.namespace, seq.tokens[: (held + n) * bs], prefix + pages)
        self.tiers.restored(n * bs, n * self.tiers.codec.page_bytes, time.perf_counter() - t)
        return n * bs


def default_host_bytes(pool_bytes: int) -> int:
    """The auto size of the host tier: 1/8 of the memory available at start (at most 64 GiB), and at least the
    KV pool's size where that is available (pages in RAM cost no prefill); all the workers of a host together
    take at most 1/8 of its memory (`host_budget.claim`)."""
    avail = _available_memory()
    if avail is None:
        return pool_bytes
    want = int(min(max(avail // 8, min(pool_bytes, avail // 4)), 64 << 30))
    return host_budget.claim(want, _total_memory() or avail)


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _available_memory() -> int | None:
    """Linux's MemAvailable (free plus reclaimable page cache), else free pages; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def make_restorer(config: EngineConfig, cache: RadixCache | None, pool: PagePool, codec: PageCodec,
                  fp: bytes) -> Restorer | None:
    """The tiers the config asks for, hooked to the cache's evictions; None without a cache or with tiers
    off."""
    if cache is None:
        return None
    host = config.kv_host_bytes
    if host is None:
        host = default_host_bytes(pool.num_pages * codec.page_bytes)
        if host <= 0:
            log.warning("KV host tier: the host's automatic budget is taken by its other workers")
            # a tier under one page holds nothing, but keeps the disk tier
            host = 1 if config.kv_disk_dir else 0
    if host <= 0:
        return None
    disk = DiskTier(config.kv_disk_dir, config.kv_disk_bytes, fp) if config.kv_disk_dir else None
    tiers = KvTiers(codec, host, disk, config.kv_disk_min_hits, cache.events)
    cache.on_evict = tiers.offload
    log.info("KV tiers: host RAM %d MB, disk %s", host >> 20,
             f"{config.kv_disk_dir} ({config.kv_disk_bytes >> 20} MB)" if disk else "off")
    return Restorer(tiers, cache, pool, config.block_size)
