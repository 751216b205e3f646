"""Prefix-cache-aware routing of requests to workers, and the ZeroMQ worker client.

The package face: callers import from `router`, not from its modules.
"""

from router.alias_table import ALIASES_KEY, AliasTable
from router.aliases import Alias, encode_alias, parse_alias, sticky_key, weighted_pick
from router.client import WorkerClient, WorkerError
from router.disagg import DisaggRule
from router.dispatch import Router, RouteRequest
from router.fleet import Fleet
from router.membership import Member, Membership, StatsEvent
from router.policy import (
    FALLBACK_DEAD,
    FALLBACK_DRAINING,
    FALLBACK_EXCLUDED,
    FALLBACK_FOOTPRINT,
    FALLBACK_HOLDER,
    FALLBACK_INCOMPATIBLE,
    FALLBACK_LOAD,
    Choice,
    NoWorkerAvailable,
)
from router.pools import PoolView, Served
from router.prefix import fairness_key, key_span, namespace_root, prefix_key

__all__ = [
    "ALIASES_KEY",
    "Alias",
    "AliasTable",
    "Fleet",
    "PoolView",
    "Served",
    "encode_alias",
    "parse_alias",
    "sticky_key",
    "weighted_pick",
    "FALLBACK_DEAD",
    "FALLBACK_DRAINING",
    "FALLBACK_EXCLUDED",
    "FALLBACK_FOOTPRINT",
    "FALLBACK_HOLDER",
    "FALLBACK_INCOMPATIBLE",
    "FALLBACK_LOAD",
    "Choice",
    "DisaggRule",
    "Member",
    "Membership",
    "NoWorkerAvailable",
    "RouteRequest",
    "Router",
    "StatsEvent",
    "WorkerClient",
    "WorkerError",
    "key_span",
    "fairness_key",
    "namespace_root",
    "prefix_key",
]
