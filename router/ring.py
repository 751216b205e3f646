"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

`HashRing` places `vnodes` virtual nodes per worker at xxh3-64 positions of "<worker
id>#<i>", so every gateway replica with the same membership builds the same ring and
maps a key to the same worker. `choose` walks clockwise from the key's point and
takes the first eligible (live, not draining, not excluded) worker whose outstanding
KV tokens are below (1 + epsilon) x mean load, the mean including the new request's
cost; skipped workers are reported as the fallback reason for metrics. Two
cache-aware refinements use what the caller learned from its own traffic. A prefix
some workers are expected to hold (`held`): the first holder on the walk within the
bound is taken before any non-holder (a prefix that spilled under load stays where
it went), and a holder may exceed the bound by the prefix tokens it will not compute
again: the request adds only its new tokens there, while moving it would add them
all elsewhere and lose the hit. No worker ends above the bound plus one request's
cost either way. A prefix no worker holds yet (`footprints`: the prefix tokens the
caller has placed on each worker and still counts, see `router.holders`): the first
worker on the walk within the load bound whose footprint is below (1 +
footprint_epsilon) x mean footprint. This is the same bounded-loads rule applied to
cache space: a ring alone gives one of 3 workers 8 or more of 16 prefixes about 40%
of the time, more than its cache holds, and its misses then pile up there. With
nothing learned, every replica maps a key to the same worker. Keyless requests go to
the least-loaded eligible worker, ties broken at random. The ring holds every known
member, eligible or not, so a worker that dies and comes back gets exactly its old
keys back.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import xxhash

from router.prefix import key_point

DEFAULT_VNODES = 100
DEFAULT_EPSILON = 0.25
# Tighter than the load bound: a prefix placed is cache space taken for as long as it stays in use.
DEFAULT_FOOTPRINT_EPSILON = 0.1

# Fallback reasons, in the order they are attributed (first skip of the home worker wins).
FALLBACK_DEAD = "dead"
FALLBACK_DRAINING = "draining"
FALLBACK_EXCLUDED = "excluded"
FALLBACK_LOAD = "load"
FALLBACK_HOLDER = "holder"  # the home did not hold the prefix; a later worker on the walk did
FALLBACK_FOOTPRINT = "footprint"  # a new prefix skipped a home already holding over its share of prefixes


@dataclass(slots=True)
class Choice:
    """A routing decision: the worker, and why the key's home worker was not taken (None if it was)."""

    worker_id: str
    fallback: str | None = None


class NoWorkerAvailable(RuntimeError):
    """No eligible worker exists (all dead, draining or excluded)."""


def vnode_position(worker_id: str, i: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{worker_id}#{i}".encode())


class HashRing:
    """Ring of virtual nodes over the known workers; pure and synchronous."""

    def __init__(
        self,
        workers: Iterable[str] = (),
        *,
        vnodes: int = DEFAULT_VNODES,
        epsilon: float = DEFAULT_EPSILON,
        footprint_epsilon: float = DEFAULT_FOOTPRINT_EPSILON,
        rng: random.Random | None = None,
    ) -> None:
        if vnodes <= 0:
            raise ValueError("vnodes must be > 0")
        if epsilon < 0 or footprint_epsilon < 0:
            raise ValueError("epsilon and footprint_epsilon must be >= 0")
        self.vnodes = vnodes
        self.epsilon = epsilon
        self.footprint_epsilon = footprint_epsilon
        self._rng = rng or random.Random()
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

    def choose(
        self,
        key: bytes | None,
        cost: int,
        loads: Mapping[str, float],
        *,
        eligible: Callable[[str], str | None],
        exclude: frozenset[str] = frozenset(),
        held: Callable[[str], int] | None = None,
        footprints: Mapping[str, float] | None = None,
        span: int = 0,
    ) -> Choice:
        """Pick a worker for a request of `cost` KV tokens.

        `loads` gives each member's outstanding KV tokens (missing = 0).
        `eligible(w)` returns None if `w` may take new requests, else a fallback
        reason (FALLBACK_DEAD, FALLBACK_DRAINING). `held(w)` is how many of the
        request's tokens `w` is expected to have cached (default 0).
        `footprints` (prefix tokens already placed on each worker, all 0 = no
        preference) and `span` (the request's prefix tokens) place a prefix no
        worker is known to hold.
        """
        if cost < 0:
            raise ValueError("cost must be >= 0")
        usable = [w for w in self._members if w not in exclude and eligible(w) is None]
        if not usable:
            raise NoWorkerAvailable("no live, non-draining worker")
        if key is None:
            return Choice(self._least_loaded(usable, loads))
        bound = (1.0 + self.epsilon) * (sum(loads.get(w, 0.0) for w in usable) + cost) / len(usable)
        walk = self.walk(key)
        candidates = [w for w in walk if w in usable]

        def fits(w: str) -> bool:
            load = loads.get(w, 0.0) - (min(held(w), cost) if held else 0)
            return load < bound or load <= 0

        holders = [w for w in candidates if held is not None and held(w) > 0]
        if holders:
            taken = next((w for w in holders if fits(w)), None)
            if taken is not None:
                return Choice(taken, None if taken == candidates[0] else FALLBACK_HOLDER)
        elif footprints is not None and span > 0:
            share = (1.0 + self.footprint_epsilon) * (sum(footprints.get(w, 0) for w in usable) + span) / len(usable)
            taken = next((w for w in candidates if fits(w) and footprints.get(w, 0) < share), None)
            if taken is not None:
                home = candidates[0]
                return Choice(taken, None if taken == home else FALLBACK_FOOTPRINT if fits(home) else FALLBACK_LOAD)
        plain = self._walk_bounded(walk, fits, eligible, exclude)
        # None is unreachable in exact arithmetic (the least-loaded worker is below the bound); a guard.
        return plain or Choice(self._least_loaded(usable, loads), FALLBACK_LOAD)

    @staticmethod
    def _walk_bounded(walk: list[str], fits: Callable[[str], bool],
                      eligible: Callable[[str], str | None], exclude: frozenset[str]) -> Choice | None:
        """Plain bounded loads: the first eligible worker on the walk below the bound."""
        fallback: str | None = None
        for w in walk:
            if w in exclude:
                fallback = fallback or FALLBACK_EXCLUDED
                continue
            reason = eligible(w)
            if reason is not None:
                fallback = fallback or reason
                continue
            if fits(w):
                return Choice(w, fallback)
            fallback = fallback or FALLBACK_LOAD
        return None

    def _least_loaded(self, usable: list[str], loads: Mapping[str, float]) -> str:
        low = min(loads.get(w, 0.0) for w in usable)
        ties = sorted(w for w in usable if loads.get(w, 0.0) == low)
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)
