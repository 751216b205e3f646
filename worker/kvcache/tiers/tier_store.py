"""The tiers as the engine sees them: pages the radix cache evicts go in, a prompt's next blocks come out.

Write policy: write-back. An evicted page is copied to host RAM (once: a page already there is only touched);
a page leaving RAM goes on to disk when its requests allowed it ("24h" or no retention asked) and it was hit
at least `disk_min_hits` times (matched in the prefix cache or restored from RAM). Host RAM is inclusive: a
restored page stays there, so evicting it again costs no copy.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from worker.kvcache.events import KvEvents
from worker.kvcache.tiers.cost import CostModel
from worker.kvcache.tiers.disk import DiskTier
from worker.kvcache.tiers.host import HostTier, TierPage
from worker.kvcache.tiers.pages import PageCodec
from worker.protocol import block_id

MAX_DURABLE = 1 << 20  # block digests remembered as allowed on disk
MAX_PREFETCH = 256  # disk reads in flight or done and not yet taken


@dataclass(slots=True)
class TierStats:
    """Counters per tier since start (`ram_*`, `disk_*`) and the restore totals."""

    ram_pages: int = 0
    ram_bytes: int = 0
    ram_hits: int = 0  # pages restored from RAM
    ram_evictions: int = 0
    disk_pages: int = 0
    disk_bytes: int = 0
    disk_hits: int = 0  # pages read back from disk for a request (restored, or prefetched into RAM)
    disk_evictions: int = 0
    disk_writes: int = 0
    disk_dropped: int = 0  # writes dropped: queue full or disk full
    disk_corrupt: int = 0  # bad files detected (recomputed)
    disk_full: bool = False
    restored_tokens: int = 0
    restored_bytes: int = 0
    load_seconds: float = 0.0
    skipped_by_cost: int = 0  # restores the cost model turned down


class KvTiers:
    """Host RAM (and an optional disk tier) below one worker's radix cache. Engine thread only, except the
    disk tier's own writer and the prefetch reader."""

    def __init__(self, codec: PageCodec, host_bytes: int, disk: DiskTier | None = None,
                 disk_min_hits: int = 1, events: KvEvents | None = None) -> None:
        self.codec = codec
        self.host = HostTier(host_bytes)
        self.disk = disk
        self.disk_min_hits = disk_min_hits
        self.events = events
        self.cost = CostModel(codec.page_bytes)
        self.stats = TierStats()
        self._durable: OrderedDict[bytes, None] = OrderedDict()
        self._in_memory: OrderedDict[bytes, None] = OrderedDict()  # "in_memory" retention asked for these
        # prefix-cache hits per block (the disk gate's count)
        self._uses: OrderedDict[bytes, int] = OrderedDict()
        self._prefetch: dict[bytes, Future[torch.Tensor | None]] = {}
        self._reader = ThreadPoolExecutor(1,
                                          thread_name_prefix="kv-disk-reader") if disk is not None else None
        if events is not None:
            events.tier_held = self.held_block_ids

    # ---- in: the radix cache's eviction hook ----

    def offload(self, hashes: list[bytes], pages: list[int]) -> None:
        """Keep evicted pages (their block digests and page ids; called before the pages are freed)."""
        new = [i for i, h in enumerate(hashes) if not self.host.touch(h)]
        if not new:
            return
        rows = self.codec.read([pages[i] for i in new])
        stored = []
        for j, i in enumerate(new):
            key = hashes[i]
            page = TierPage(rows[j].clone(), self._uses.get(key, 0),
                            durable=key in self._durable and key not in self._in_memory)
            for out_key, out in self.host.put(key, page):
                self._leave_ram(out_key, out)
            if key in self.host:
                stored.append(block_id(key))
        self._report(stored, [])

    def _leave_ram(self, key: bytes, page: TierPage) -> None:
        self.stats.ram_evictions += 1
        disk = self.disk
        if (disk is not None and page.durable and page.hits >= self.disk_min_hits
                and disk.submit(key, page.data)):
            return
        if disk is None or key not in disk:
            self._report([], [block_id(key)])

    # ---- retention and reuse ----

    def used(self, hashes: Iterable[bytes]) -> None:
        """A request matched these blocks in the prefix cache: one more hit each (bounded memory)."""
        if self.disk is None:
            return
        uses = self._uses
        for h in hashes:
            uses[h] = uses.get(h, 0) + 1
            uses.move_to_end(h)
        while len(uses) > MAX_DURABLE:
            uses.popitem(last=False)

    def retain(self, hashes: Iterable[bytes], retention: str) -> None:
        """Record a request's retention for its blocks: "24h" (or none asked) may go to disk, "in_memory"
        not."""
        if self.disk is None:
            return
        mark, clear = (self._in_memory, self._durable) if retention == "in_memory" else (self._durable,
                                                                                         self._in_memory)
        for h in hashes:
            clear.pop(h, None)
            mark[h] = None
            mark.move_to_end(h)
            page = self.host.get(h) if retention == "in_memory" else None
            if page is not None:
                page.durable = False
        for d in (self._durable, self._in_memory):
            while len(d) > MAX_DURABLE:
                d.popitem(last=False)

    # ---- out: restore ----

    def available(self, hashes: list[bytes], start: int) -> tuple[int, int, int]:
        """From block `start` on: (contiguous blocks held in a tier, their bytes in RAM, their bytes on
        disk)."""
        n = ram = disk_b = 0
        size = self.codec.page_bytes
        for h in hashes[start:]:
            if h in self.host:
                ram += size
            elif self.disk is not None and (h in self._prefetch or h in self.disk):
                disk_b += size
            else:
                break
            n += 1
        return n, ram, disk_b

    def prefetch(self, hashes: list[bytes]) -> None:
        """Start reading the disk-only blocks of a prompt while its request waits."""
        if self._reader is None or self.disk is None:
            return
        for h in hashes:
            if h in self.host or h in self._prefetch:
                continue
            if h not in self.disk or len(self._prefetch) >= MAX_PREFETCH:
                break
            self._prefetch[h] = self._reader.submit(self._read_disk, h)

    def _read_disk(self, key: bytes) -> torch.Tensor | None:
        t = time.perf_counter()
        data = self.disk.load(key)  # type: ignore[union-attr]
        if data is not None:
            self.cost.disk.add(data.numel(), time.perf_counter() - t)
        return data

    def load(self, hashes: list[bytes]) -> torch.Tensor:
        """[n, page_bytes] rows of the leading `hashes` a tier still holds intact (n may be fewer, even 0)."""
        rows: list[torch.Tensor] = []
        for h in hashes:
            page = self.host.get(h)
            if page is None:
                data = self._take_disk(h)
                if data is None or data.numel() != self.codec.page_bytes:
                    break
                page = TierPage(data, durable=True)
                self.stats.disk_hits += 1
                for out_key, out in self.host.put(h, page):
                    self._leave_ram(out_key, out)
            else:
                self.stats.ram_hits += 1
            page.hits += 1
            rows.append(page.data)
        if not rows:
            return torch.empty(0, self.codec.page_bytes, dtype=torch.uint8)
        return torch.stack(rows)

    def _take_disk(self, key: bytes) -> torch.Tensor | None:
        fut = self._prefetch.pop(key, None)
        if fut is not None:
            return fut.result()
        return self._read_disk(key) if self.disk is not None else None

    def restored(self, tokens: int, n_bytes: int, seconds: float) -> None:
        self.stats.restored_tokens += tokens
        self.stats.restored_bytes += n_bytes
        self.stats.load_seconds += seconds
        self.cost.restore.add(n_bytes, seconds)

    # ---- reporting ----

    def settle(self) -> None:
        """Once a step: finished prefetches move into RAM; disk files that went are reported (unless RAM holds
        them)."""
        disk = self.disk
        if disk is None:
            return
        for key in [k for k, f in self._prefetch.items() if f.done()]:
            data = self._prefetch.pop(key).result()
            if data is not None and data.numel() == self.codec.page_bytes and key not in self.host:
                self.stats.disk_hits += 1
                for out_key, out in self.host.put(key, TierPage(data, durable=True)):
                    self._leave_ram(out_key, out)
        gone = []
        while disk.gone:
            key = disk.gone.popleft()
            if key not in self.host:
                gone.append(block_id(key))
        self._report([], gone)

    def held_block_ids(self) -> list[int]:
        keys = set(self.host.keys())
        if self.disk is not None:
            keys.update(self.disk.keys())
        return [block_id(k) for k in keys]

    def snapshot_stats(self) -> TierStats:
        s, host, disk = self.stats, self.host, self.disk
        s.ram_pages, s.ram_bytes = len(host), host.bytes
        if disk is not None:
            s.disk_pages, s.disk_bytes, s.disk_evictions = len(disk), disk.bytes, disk.evictions
            s.disk_writes, s.disk_dropped = disk.writes, disk.dropped
            s.disk_corrupt, s.disk_full = disk.corrupt, disk.full
        return s

    def _report(self, stored: list[int], dropped: list[int]) -> None:
        if self.events is not None and (stored or dropped):
            self.events.tier_changes(stored, dropped)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()
