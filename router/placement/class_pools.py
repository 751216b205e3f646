"""Traffic-class pools: a priority class prefers the workers of its pool label and spills to the others when
the worker its pool offers is over the bounded-load limit over every usable worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

SPILL = "spill"  # metrics: a request left its class's pool under load


def outside_pool(members: Iterable[str], pool_of: Callable[[str], str], label: str) -> frozenset[str] | None:
    """The members outside pool `label`; None when no member carries it or every member does (no
    preference)."""
    inside: list[str] = []
    outside: list[str] = []
    for m in members:
        (inside if pool_of(m) == label else outside).append(m)
    if not inside or not outside:
        return None
    return frozenset(outside)


def over_bound(chosen: str, usable: Iterable[str], loads: Mapping[str, float], cost: int,
               epsilon: float) -> bool:
    """`chosen` is at or over (1 + epsilon) x the mean load of every usable worker (this request counted)."""
    usable = list(usable)
    if not usable:
        return False
    mean = (sum(loads.get(w, 0.0) for w in usable) + cost) / len(usable)
    load = loads.get(chosen, 0.0)
    return load > 0 and load >= (1.0 + epsilon) * mean
