"""The routing policy: consistent hashing with bounded loads (Mirrokni et al. 2018), made cache-aware.

One pure `choose` over a `Candidates` view, so every rule and fallback
reason lives here; `RoutingPolicy` adds the ring.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from router.placement.ring import DEFAULT_VNODES, HashRing

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
FALLBACK_INCOMPATIBLE = "incompatible"  # the home's block-hash contract differs from this gateway's (refused)


@dataclass(slots=True)
class Choice:
    """A routing decision: the worker, and why the key's home worker was not taken (None if it was)."""

    worker_id: str
    fallback: str | None = None


class NoWorkerAvailable(RuntimeError):
    """No eligible worker exists (all dead, draining or excluded)."""


@dataclass(slots=True, frozen=True)
class Bounds:
    """Slack over the mean: loads below (1 + epsilon) x mean fit; new
    prefixes go below (1 + footprint) x mean."""

    epsilon: float = DEFAULT_EPSILON
    footprint: float = DEFAULT_FOOTPRINT_EPSILON

    def __post_init__(self) -> None:
        if self.epsilon < 0 or self.footprint < 0:
            raise ValueError("epsilon and footprint_epsilon must be >= 0")


@dataclass(slots=True, frozen=True)
class Candidates:
    """The workers as one routing decision sees them."""

    order: tuple[str, ...]  # every ring member: the key's walk, or any order when keyless
    status: Mapping[str, str | None]  # None: may take new requests; else why not (FALLBACK_DEAD, _DRAINING)
    loads: Mapping[str, float]  # outstanding KV tokens (missing: 0)
    keyed: bool = True
    excluded: frozenset[str] = frozenset()
    # prompt tokens of the prefix each worker should hold
    held: Mapping[str, int] = field(default_factory=dict)
    # prefix tokens placed on each worker; None: no footprint rule
    footprints: Mapping[str, float] | None = None

    def reason(self, worker_id: str) -> str | None:
        if worker_id in self.excluded:
            return FALLBACK_EXCLUDED
        return self.status.get(worker_id, FALLBACK_DEAD)


def choose(view: Candidates, cost: int, *, span: int = 0, bounds: Bounds = Bounds(),
           rng: random.Random | None = None) -> Choice:
    """Pick a worker for a request of `cost` KV tokens whose key covers `span` prompt tokens.

    Keyed: the holder of the longest prefix that fits, ties in walk order (a holder may exceed the bound by
    what it need not recompute), else for a new prefix the first fitting worker below its footprint share,
    else plain bounded loads on the walk. Keyless: the least-loaded usable worker, ties broken at random.
    """
    if cost < 0:
        raise ValueError("cost must be >= 0")
    usable = [w for w in view.order if w not in view.excluded and view.status.get(w, FALLBACK_DEAD) is None]
    if not usable:
        raise NoWorkerAvailable("no live, non-draining worker")
    if not view.keyed:
        return Choice(_least_loaded(usable, view.loads, rng))
    bound = (1.0 + bounds.epsilon) * (sum(view.loads.get(w, 0.0) for w in usable) + cost) / len(usable)

    def fits(w: str) -> bool:
        load = view.loads.get(w, 0.0) - min(view.held.get(w, 0), cost)
        return load < bound or load <= 0

    holders = sorted((w for w in usable if view.held.get(w, 0) > 0), key=lambda w: -view.held[w])  # stable
    if holders:
        taken = next((w for w in holders if fits(w)), None)
        if taken is not None:
            return Choice(taken, None if taken == usable[0] else FALLBACK_HOLDER)
    elif view.footprints is not None and span > 0:
        placed = _place_new_prefix(view.footprints, usable, span, bounds, fits)
        if placed is not None:
            return placed
    return _walk_bounded(view, fits) or Choice(_least_loaded(usable, view.loads, rng), FALLBACK_LOAD)


def _place_new_prefix(footprints: Mapping[str, float], usable: list[str], span: int, bounds: Bounds,
                      fits: Callable[[str], bool]) -> Choice | None:
    """The first worker on the walk within the load bound whose footprint
    is below its share (bounded cache space)."""
    share = (1.0 + bounds.footprint) * (sum(footprints.get(w, 0) for w in usable) + span) / len(usable)
    taken = next((w for w in usable if fits(w) and footprints.get(w, 0) < share), None)
    if taken is None:
        return None
    home = usable[0]
    return Choice(taken, None if taken == home else FALLBACK_FOOTPRINT if fits(home) else FALLBACK_LOAD)


def _walk_bounded(view: Candidates, fits: Callable[[str], bool]) -> Choice | None:
    """Plain bounded loads: the first usable worker on the walk that fits, and why the home was skipped."""
    fallback: str | None = None
    for w in view.order:
        reason = view.reason(w)
        if reason is not None:
            fallback = fallback or reason
            continue
        if fits(w):
            return Choice(w, fallback)
        fallback = fallback or FALLBACK_LOAD
    # None is unreachable in exact arithmetic (the least-loaded worker is below the bound); the caller guards.
    return None


def _least_loaded(usable: list[str], loads: Mapping[str, float], rng: random.Random | None) -> str:
    low = min(loads.get(w, 0.0) for w in usable)
    ties = sorted(w for w in usable if loads.get(w, 0.0) == low)
    return ties[0] if len(ties) == 1 else (rng or random).choice(ties)


class RoutingPolicy:
    """The ring over the known workers (eligible or not, so a worker that comes back gets its keys back) and
    `choose`."""

    def __init__(self, *, vnodes: int = DEFAULT_VNODES, epsilon: float = DEFAULT_EPSILON,
                 footprint_epsilon: float = DEFAULT_FOOTPRINT_EPSILON,
                 rng: random.Random | None = None) -> None:
        self.bounds = Bounds(epsilon, footprint_epsilon)
        self._ring = HashRing(vnodes=vnodes)
        self._rng = rng or random.Random()

    @property
    def members(self) -> frozenset[str]:
        return self._ring.members

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._ring

    def add(self, worker_id: str) -> None:
        self._ring.add(worker_id)

    def remove(self, worker_id: str) -> None:
        self._ring.remove(worker_id)

    def order(self, key: bytes | None) -> tuple[str, ...]:
        """The key's walk over the ring, or every member (sorted) for a keyless request."""
        return tuple(self._ring.walk(key)) if key is not None else tuple(sorted(self._ring.members))

    def choose(self, view: Candidates, cost: int, span: int = 0) -> Choice:
        return choose(view, cost, span=span, bounds=self.bounds, rng=self._rng)
