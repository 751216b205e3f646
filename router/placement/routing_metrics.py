"""Prometheus collectors for routing decisions (`switchyard_router_*`, `switchyard_disagg_*`), labelled by
worker id, fallback reason or outcome.

Label sets stay bounded: a departed worker's series are removed,
reasons are a fixed set, no tenant data appears.
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

from common.trace_context import traceparent, tracer
from router.placement.policy import Choice
from worker.protocol import PrefillHint

REQUESTS = Counter(
    "switchyard_router_requests",
    "Requests dispatched to each worker (failover re-sends included)", ["worker"]
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
    "(load, dead, draining, excluded, failover, holder, footprint, incompatible)",
    ["reason"],
)

RESUMES = Counter(
    "switchyard_router_resumes",
    "Streams carried on after tokens were streamed, by reason (worker_lost, drain, link, abandoned: the "
    "worker gave up on this gateway while its loop stalled)",
    ["reason"],
)
RESUME_GAP = Histogram(
    "switchyard_router_resume_gap_seconds",
    "Seconds from a resumed stream's failure to its first chunk from the next worker",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0),
)

PREDICTED_TOKENS = Counter(
    "switchyard_router_predicted_cached_tokens",
    "Prompt tokens the router expected the chosen worker to have cached, at routing time", ["worker"],
)
PRECISION = Histogram(
    "switchyard_router_precision",
    "Per request with a predicted hit: the share of the predicted cached tokens the worker really had cached",
    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
)
KV_INDEX_BLOCKS = Gauge(
    "switchyard_router_kv_index_blocks",
    "Block ids each worker reports holding, as this gateway indexes them", ["worker"],
)
KV_SYNCS = Counter(
    "switchyard_router_kv_syncs",
    "Block snapshots asked of workers, by reason (gap, overflow, corrupt, stale)", ["reason"],
)
REFUSED = Counter(
    "switchyard_router_refused_workers",
    "Workers refused for a block-hash contract unlike this gateway's, by field (block_size, hash, tokenizer)",
    ["reason"],
)

DISAGG_REQUESTS = Counter(
    "switchyard_disagg_requests",
    "Routed attempts by where their prefill ran: remote (a prefill worker) or local (the decode worker "
    "itself)",
    ["outcome"],
)
DISAGG_FALLBACKS = Counter(
    "switchyard_disagg_fallbacks",
    "Attempts prefilled locally although the pool has prefill workers, by reason (short, no_prefill_worker, "
    "prefill_queue)",
    ["reason"],
)

_PER_WORKER = (REQUESTS, OUTSTANDING_TOKENS, PREFIX_HIT_RATE, CACHED_TOKENS, PREDICTED_TOKENS,
               KV_INDEX_BLOCKS)


def forget_worker(worker_id: str) -> None:
    """Drop a departed worker's series so the label set stays bounded by the live membership."""
    for metric in _PER_WORKER:
        with contextlib.suppress(KeyError):
            metric.remove(worker_id)


def route_span(choice: Choice, predicted: int, resumed: int, hint: PrefillHint | None) -> str:
    """Record the routing decision as a span (a child of the request's) and return its `traceparent` for the
    worker's spans; "" when tracing is off."""
    tr = tracer("switchyard.router")
    if tr is None:
        return ""
    span = tr.start_span("route", attributes={
        "switchyard.worker": choice.worker_id, "switchyard.route.reason": choice.fallback or "home",
        "switchyard.route.predicted_cached_tokens": predicted, "switchyard.route.resumed_tokens": resumed})
    if hint is not None:
        span.set_attribute("switchyard.route.prefill_worker", hint.worker_id)
    span.end()
    return traceparent(span)
