"""The host-RAM tier: evicted pages as compact byte rows by block digest, least recently used out first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)
class TierPage:
    """One page's bytes (`worker.kvcache.tiers.pages.PageCodec` rows) and what the write policy needs."""

    data: torch.Tensor  # uint8 [page_bytes] on the host
    hits: int = 0  # prefix-cache matches and restores of this page (the disk tier's gate)
    durable: bool = False  # a request asked for "24h" retention: it may go on to disk


class HostTier:
    """At most `capacity_bytes` of pages; `put` evicts the least recently used and returns what left."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._pages: OrderedDict[bytes, TierPage] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def keys(self) -> list[bytes]:
        return list(self._pages)

    def get(self, key: bytes) -> TierPage | None:
        """The page under `key`, now most recently used (None when absent)."""
        page = self._pages.get(key)
        if page is not None:
            self._pages.move_to_end(key)
        return page

    def touch(self, key: bytes) -> bool:
        return self.get(key) is not None

    def put(self, key: bytes, page: TierPage) -> list[tuple[bytes, TierPage]]:
        """Store `page` (replacing one under `key`); returns the pages evicted to stay within the bound."""
        size = page.data.numel()
        if size > self.capacity_bytes:
            return [(key, page)]
        old = self._pages.pop(key, None)
        if old is not None:
            self.bytes -= old.data.numel()
            page.hits, page.durable = max(page.hits, old.hits), page.durable or old.durable
        out = []
        while self.bytes + size > self.capacity_bytes:
            k, p = self._pages.popitem(last=False)
            self.bytes -= p.data.numel()
            self.evictions += 1
            out.append((k, p))
        self._pages[key] = page
        self.bytes += size
        return out

    def pop(self, key: bytes) -> TierPage | None:
        page = self._pages.pop(key, None)
        if page is not None:
            self.bytes -= page.data.numel()
        return page
