"""Prefix-cache-aware routing of requests to workers, and the ZeroMQ worker client.

The package face: callers import from `router`, not from its modules.
"""

from router.client import WorkerClient, WorkerError
from router.dispatch import Router, RouteRequest
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
from router.prefix import fairness_key, key_span, namespace_root, prefix_key

__all__ = [
    "FALLBACK_DEAD",
    "FALLBACK_DRAINING",
    "FALLBACK_EXCLUDED",
    "FALLBACK_FOOTPRINT",
    "FALLBACK_HOLDER",
    "FALLBACK_INCOMPATIBLE",
    "FALLBACK_LOAD",
    "Choice",
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
