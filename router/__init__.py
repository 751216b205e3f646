"""Prefix-cache-aware routing of requests to workers, and the ZeroMQ worker client.

The package face: callers import from `router`, not from its modules.
"""

from router.disagg.prefill_target import DisaggRule
from router.dispatch import Routed, Router, RouteRequest
from router.fleet import Fleet
from router.links.client import WorkerClient, WorkerError
from router.links.kv_feed import KvFeeds
from router.links.kv_ingest import FeedSource
from router.links.membership import Member, Membership, StatsEvent
from router.placement.policy import (
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
from router.placement.prefix import fairness_key, key_span, namespace_root, prefix_key
from router.pools.alias_table import ALIASES_KEY, AliasTable
from router.pools.aliases import Alias, encode_alias, parse_alias, sticky_key, weighted_pick
from router.pools.served import PoolView, Served

__all__ = [
    "ALIASES_KEY",
    "Alias",
    "AliasTable",
    "FeedSource",
    "Fleet",
    "KvFeeds",
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
    "Routed",
    "Router",
    "StatsEvent",
    "WorkerClient",
    "WorkerError",
    "key_span",
    "fairness_key",
    "namespace_root",
    "prefix_key",
]
