"""Rename the keys that carried no hash tag before Redis Cluster support to their tagged names.

DUMP/RESTORE (not RENAME, which a cluster refuses across slots) keeps each key's TTL; a sorted set whose new
name already exists is merged into it; running it again finds nothing left to move.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import redis
from redis.exceptions import ResponseError

from common.worker_registry import (
    LEGACY_REGISTRY_KEY_PREFIX,
    LEGACY_REGISTRY_SET_KEY,
    REGISTRY_KEY_PREFIX,
    REGISTRY_SET_KEY,
)
from tenancy.schema import GATEWAYS_KEY, LEGACY_GATEWAYS_KEY


@dataclass(slots=True)
class MigrationReport:
    """What one run did: (old, new) names moved, merged into an existing key, or dropped for a newer one."""

    moved: list[tuple[str, str]] = field(default_factory=list)
    merged: list[tuple[str, str]] = field(default_factory=list)
    superseded: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.moved) + len(self.merged) + len(self.superseded)


def legacy_keys(r: redis.Redis) -> Iterator[tuple[str, str]]:
    """(old name, tagged name) of every untagged Switchyard key present now."""
    for old, new in ((LEGACY_GATEWAYS_KEY, GATEWAYS_KEY), (LEGACY_REGISTRY_SET_KEY, REGISTRY_SET_KEY)):
        if r.exists(old):
            yield old, new
    for raw in r.scan_iter(match=LEGACY_REGISTRY_KEY_PREFIX + "*", count=500):
        old = raw.decode()
        yield old, REGISTRY_KEY_PREFIX + old[len(LEGACY_REGISTRY_KEY_PREFIX):]


def migrate_keys(r: redis.Redis, dry_run: bool = False) -> MigrationReport:
    """Move every legacy key to its tagged name (see the module docstring); `dry_run` only lists them."""
    report = MigrationReport()
    for old, new in list(legacy_keys(r)):
        if dry_run:
            report.moved.append((old, new))
            continue
        outcome = _move(r, old, new)
        if outcome is not None:
            getattr(report, outcome).append((old, new))
    return report


def _move(r: redis.Redis, old: str, new: str) -> str | None:
    """Move one key; returns the report list it belongs to, or None when it vanished (expired) meanwhile."""
    pttl, data = r.pttl(old), r.dump(old)
    if data is None or pttl == -2:
        return None
    try:
        r.restore(new, max(pttl, 0), data)  # 0: no expiry (pttl -1)
        outcome = "moved"
    except ResponseError as exc:
        if "BUSYKEY" not in str(exc):
            raise
        outcome = _merge(r, old, new)
    r.delete(old)
    return outcome


def _merge(r: redis.Redis, old: str, new: str) -> str:
    """`new` exists: a sorted set takes the old members (the later expiry wins); anything else is newer."""
    if r.type(old) == b"zset" and r.type(new) == b"zset":
        members = dict(r.zrange(old, 0, -1, withscores=True))
        if members:
            r.zadd(new, members, gt=True)
        return "merged"
    return "superseded"
