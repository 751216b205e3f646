"""A consistent hash ring: virtual-node points per worker and each key's walk order over them.

Points are xxh3-64 of "<worker id>#<i>", so every gateway replica
with the same members walks a key the same way.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import xxhash

from router.placement.prefix import key_point

DEFAULT_VNODES = 100


def vnode_position(worker_id: str, i: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{worker_id}#{i}".encode())


class HashRing:
    """Ring of virtual nodes over the known workers; pure and synchronous."""

    def __init__(self, workers: Iterable[str] = (), *, vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes <= 0:
            raise ValueError("vnodes must be > 0")
        self.vnodes = vnodes
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for w in workers:
            self.add(w)

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._members

    def add(self, worker_id: str) -> None:
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        if worker_id in self._members:
            return
        self._members.add(worker_id)
        self._rebuild()

    def remove(self, worker_id: str) -> None:
        if worker_id in self._members:
            self._members.discard(worker_id)
            self._rebuild()

    def _rebuild(self) -> None:
        # Ties on a position (astronomically rare) are broken by worker id, so the order is deterministic.
        pairs = sorted((vnode_position(w, i), w) for w in self._members for i in range(self.vnodes))
        self._points = [p for p, _ in pairs]
        self._owners = [w for _, w in pairs]

    def walk(self, key: bytes) -> list[str]:
        """Distinct members in clockwise order from the key's point (the key's preference list)."""
        return list(self._walk(key))

    def _walk(self, key: bytes) -> Iterator[str]:
        n = len(self._owners)
        if n == 0:
            return
        start = bisect.bisect_right(self._points, key_point(key))
        seen: set[str] = set()
        for j in range(n):
            w = self._owners[(start + j) % n]
            if w not in seen:
                seen.add(w)
                yield w
                if len(seen) == len(self._members):
                    return
