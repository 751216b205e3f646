"""Prometheus collectors for routing decisions (`switchyard_router_*`), labelled by worker id or fallback reason.

Label sets stay bounded: a departed worker's series are removed, reasons are a fixed set, no tenant data appears.
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

REQUESTS = Counter(
    "switchyard_router_requests", "Requests dispatched to each worker (failover re-sends included)", ["worker"]
)
OUTSTANDING_TOKENS = Gauge(
    "switchyard_router_outstanding_tokens", "Outstanding KV tokens per worker as this gateway estimates them",
    ["worker"],
)
PREFIX_HIT_RATE = Gauge(
    "switchyard_router_prefix_hit_rate", "Prefix-cache hit rate last reported by each worker", ["worker"]
)
CACHED_TOKENS = Counter(
    "switchyard_router_cached_tokens", "Prompt tokens workers reported as served from their prefix cache",
    ["worker"],
)
FALLBACKS = Counter(
    "switchyard_router_fallbacks",
    "Requests not sent to their key's home worker, by reason "
    "(load, dead, draining, excluded, failover, holder, footprint)",
    ["reason"],
)

_PER_WORKER = (REQUESTS, OUTSTANDING_TOKENS, PREFIX_HIT_RATE, CACHED_TOKENS)


def forget_worker(worker_id: str) -> None:
    """Drop a departed worker's series so the label set stays bounded by the live membership."""
    for metric in _PER_WORKER:
        with contextlib.suppress(KeyError):
            metric.remove(worker_id)
