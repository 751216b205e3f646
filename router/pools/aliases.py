"""Model aliases: a name mapped to model versions by weight, and the
sticky weighted choice among the live ones.

The choice hashes the tenant and prefix key onto the cumulative weights, so a key keeps its version while the
weights hold, and a weight change moves only the keys of the share that moved.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import xxhash

MAX_TARGETS = 16
MAX_NAME = 128


@dataclass(slots=True, frozen=True)
class Alias:
    """An alias and its versions with weights (sorted by version key, so every gateway hashes alike)."""

    name: str
    targets: tuple[tuple[str, float], ...]

    def pick(self, live: Collection[str], sticky: bytes) -> str | None:
        """The version for `sticky` among the live targets (weights renormalised over them); when no target
        with weight is live, any live target; None when none is."""
        weighted = [(k, w) for k, w in self.targets if w > 0 and k in live]
        if not weighted:
            weighted = [(k, 1.0) for k, _ in self.targets if k in live]
        return weighted_pick(weighted, sticky) if weighted else None


def weighted_pick(weights: Sequence[tuple[str, float]], sticky: bytes) -> str:
    """The target whose share of the cumulative weights holds the sticky key's point in [0, 1)."""
    total = sum(w for _, w in weights)
    point = xxhash.xxh3_64_intdigest(sticky) / 2**64 * total
    acc = 0.0
    for key, w in weights:
        acc += w
        if point < acc:
            return key
    return weights[-1][0]


def sticky_key(tenant: str, name: str, prefix: str) -> bytes:
    """What a version choice sticks to: tenant, the name requested and the request's prefix key."""
    return b"\0".join((tenant.encode(), name.encode(), prefix.encode("utf-8", "surrogatepass")))


def parse_alias(name: str, raw: str | bytes) -> Alias:
    """An alias record: a JSON object of version key -> weight (>= 0, some > 0). ValueError when malformed."""
    if not name or len(name) > MAX_NAME:
        raise ValueError(f"alias name must be 1-{MAX_NAME} characters")
    try:
        obj = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"alias {name!r} is not JSON: {exc}") from None
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"alias {name!r} is not a non-empty JSON object of version -> weight")
    if len(obj) > MAX_TARGETS:
        raise ValueError(f"alias {name!r} has over {MAX_TARGETS} versions")
    targets: list[tuple[str, float]] = []
    for key, weight in obj.items():
        if not key or len(key) > MAX_NAME:
            raise ValueError(f"alias {name!r} names a version of bad length")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) \
                or weight < 0:
            raise ValueError(f"alias {name!r}: the weight of {key!r} is not a finite number >= 0")
        targets.append((key, float(weight)))
    if not any(w > 0 for _, w in targets):
        raise ValueError(f"alias {name!r} gives every version weight 0")
    return Alias(name, tuple(sorted(targets)))


def encode_alias(weights: dict[str, float]) -> str:
    return json.dumps(dict(sorted(weights.items())))
