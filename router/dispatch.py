"""Dispatch: route a request to a worker, stream its tokens, fail over once before the first token.

`Router.stream(request)` computes the prefix key (`router.prefix`), picks a worker
on the membership's ring with bounded loads, sends the request through that
worker's `WorkerClient` and yields its `TokenChunk`s. The request's cost is
counted against the worker in the membership's `LoadTracker` from the moment it
is sent until it ends (released in `finally`); from the first output on, net of
the prompt tokens the worker reports as served from its prefix cache. If the worker dies or answers
with a retryable error before any output, the request is re-sent once to the
next choice, excluding the failed worker; after the first chunk, a failure ends
the stream with a retryable `WorkerError`. Every wait has a deadline: the
client's inter-token timeout and worker-loss detection, plus the request's own
deadline (or `max_stream_seconds` when it has none) enforced here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from router import metrics
from router.client import TokenChunk, WorkerError
from router.membership import Membership
from router.prefix import DEFAULT_ROUTE_PREFIX_TOKENS, key_span, prefix_key
from router.ring import Choice, NoWorkerAvailable

FALLBACK_FAILOVER = "failover"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_STREAM_S = 600.0
DEADLINE_GRACE_S = 1.0  # the worker ends overdue requests itself; this only catches a silent one
# Share of a worker's KV cache that new prefixes fill freely: while caches have room, spreading
# prefixes buys nothing and costs ring affinity (and agreement between gateway replicas).
FREE_FOOTPRINT_SHARE = 0.25


@dataclass(slots=True)
class RouteRequest:
    """What the gateway hands the router. `ns` is `namespace_root(...)` of the request's tenant."""

    rid: str
    ns: bytes
    tokens: Sequence[int] | np.ndarray | bytes
    cost: int  # KV tokens the request may occupy (prompt + max_tokens); the router nets out expected hits
    sampling: dict[str, Any] = field(default_factory=dict)
    stable_len: int | None = None  # chat: tokens before the last user turn; None: raw completion
    priority: int = 0
    deadline: float = 0.0  # unix seconds; 0 = none


class Router:
    """Prefix-aware, load-bounded routing over a Membership; one per gateway process."""

    def __init__(
        self,
        membership: Membership,
        *,
        secret: bytes,
        block_size: int = DEFAULT_BLOCK_SIZE,
        route_prefix_tokens: int = DEFAULT_ROUTE_PREFIX_TOKENS,
        max_stream_seconds: float = DEFAULT_MAX_STREAM_S,
    ) -> None:
        if not secret:
            raise ValueError("secret must be non-empty bytes")
        self.membership = membership
        self.secret = secret
        self.block_size = block_size
        self.route_prefix_tokens = route_prefix_tokens
        self.max_stream_seconds = max_stream_seconds

    def key_for(self, req: RouteRequest) -> bytes | None:
        return prefix_key(req.tokens, req.stable_len, root=req.ns, secret=self.secret,
                          block_size=self.block_size, max_tokens=self.route_prefix_tokens)

    def pick(self, key: bytes | None, cost: int, exclude: frozenset[str] = frozenset(), span: int = 0) -> Choice:
        """Choose a worker (raises NoWorkerAvailable) and count the fallback, if any."""
        m = self.membership
        holders = m.loads.holders
        # the ring reads footprints only for a keyed request: a keyless one need not compute them
        footprints = self._footprints_over_allowance() if key is not None else None
        choice = m.ring.choose(key, cost, m.loads.loads(), eligible=m.status, exclude=exclude,
                               held=lambda w: holders.expected_cached(w, key), footprints=footprints, span=span)
        if choice.fallback is not None:
            metrics.FALLBACKS.labels(choice.fallback).inc()
        return choice

    def _footprints_over_allowance(self) -> dict[str, float]:
        """Prefix tokens this gateway has placed on each worker beyond FREE_FOOTPRINT_SHARE of its KV cache."""
        holders = self.membership.loads.holders
        return {wid: max(0.0, tokens - FREE_FOOTPRINT_SHARE * holders.capacity(wid))
                for wid, tokens in holders.footprints().items()}

    async def stream(self, req: RouteRequest) -> AsyncIterator[TokenChunk]:
        """Yield the request's chunks; raises WorkerError or NoWorkerAvailable (before any output)."""
        if req.cost < 0:
            raise ValueError("cost must be >= 0")
        key = self.key_for(req)
        # what a worker holds under `key` once it has prefilled this request
        span = key_span(req.tokens, req.stable_len, block_size=self.block_size, max_tokens=self.route_prefix_tokens)
        exclude: frozenset[str] = frozenset()
        failed: WorkerError | None = None
        for _ in range(2):
            try:
                choice = self.pick(key, req.cost, exclude, span)
            except NoWorkerAvailable:
                if failed is not None:
                    raise failed from None
                raise
            started = False
            attempt = self._attempt(choice.worker_id, req, key, span)
            try:
                # aclosing: a consumer that stops early closes us, and we close the attempt at once
                async with contextlib.aclosing(attempt) as chunks:
                    async for chunk in chunks:
                        started = True
                        yield chunk
                return
            except WorkerError as err:
                overdue = req.deadline > 0 and time.time() >= req.deadline
                if started or not err.retryable or failed is not None or overdue:
                    raise
                failed = err
                exclude = exclude | {choice.worker_id}
                metrics.FALLBACKS.labels(FALLBACK_FAILOVER).inc()

    async def _attempt(self, wid: str, req: RouteRequest, key: bytes | None,
                       span: int) -> AsyncIterator[TokenChunk]:
        m = self.membership
        client = m.client(wid)
        loads = m.loads
        loop = asyncio.get_running_loop()
        hard_deadline = loop.time() + self._time_left(req)
        loads.add(wid, req.rid, req.cost, m.clock(), loads.holders.expected_cached(wid, key))
        # Once this request is prefilled the worker holds its prefix: a request with the same key sent
        # there meanwhile waits for those pages instead of recomputing them (DESIGN.md, worker engine).
        loads.holders.remember(wid, key, span)
        metrics.REQUESTS.labels(wid).inc()
        metrics.OUTSTANDING_TOKENS.labels(wid).set(loads.load(wid))
        stream = client.generate(req.rid, req.ns, req.tokens, req.sampling, req.priority, req.deadline)
        first = True
        cached = 0
        try:
            # Each wait inside is bounded by the client's inter-token timeout and worker-loss check;
            # the request's own deadline is checked per chunk (a timeout context would fire in the
            # consumer's code while this generator is suspended at `yield`).
            async for chunk in stream:
                if first:
                    first = False
                    loads.first_output(wid, req.rid, m.clock(), chunk.cached_tokens)
                    if chunk.cached_tokens > span:
                        loads.holders.remember(wid, key, chunk.cached_tokens)
                cached = max(cached, chunk.cached_tokens)
                if loop.time() > hard_deadline:
                    raise WorkerError("timeout", "request deadline passed", True)
                if chunk.finish_reason is not None:
                    # settle now: a consumer may stop iterating at the final chunk and never close us
                    self._settle(wid, req.rid, cached)
                    cached = 0
                yield chunk
        finally:
            self._settle(wid, req.rid, cached)
            await stream.aclose()  # sends abort when the stream did not finish

    def _settle(self, wid: str, rid: str, cached: int) -> None:
        """End the request's load accounting (idempotent)."""
        loads = self.membership.loads
        loads.release(wid, rid)
        if wid in self.membership.ring:
            metrics.OUTSTANDING_TOKENS.labels(wid).set(loads.load(wid))
            if cached:
                metrics.CACHED_TOKENS.labels(wid).inc(cached)

    def _time_left(self, req: RouteRequest) -> float:
        if req.deadline <= 0:
            return self.max_stream_seconds
        return max(0.0, min(req.deadline - time.time() + DEADLINE_GRACE_S, self.max_stream_seconds))
