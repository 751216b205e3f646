"""The Router: route a request to a worker, stream its tokens, fail over once before the first token.

It owns what routing learns (loads, prefix holders, the policy's ring), kept in step with the Membership.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.priorities import Priority
from router.disagg.prefill_target import Disaggregation, DisaggRule, member_role
from router.links.client import WorkerError
from router.links.membership import Member, Membership, StatsEvent, StatsListener
from router.links.resuming import resume_reason, with_streamed
from router.placement import routing_metrics
from router.placement.class_pools import SPILL, outside_pool, over_bound
from router.placement.holders import InFlightPrefixes, PrefixHolders
from router.placement.kv_view import KvView, beyond_common
from router.placement.load import LoadTracker
from router.placement.policy import (
    DEFAULT_EPSILON,
    DEFAULT_FOOTPRINT_EPSILON,
    FALLBACK_INCOMPATIBLE,
    Candidates,
    Choice,
    NoWorkerAvailable,
    RoutingPolicy,
)
from router.placement.prefix import (
    DEFAULT_ROUTE_PREFIX_TOKENS,
    cache_key_route,
    key_span,
    prefix_key,
    token_count,
)
from worker.protocol import ErrorCode, OutItem, SamplingParams

FALLBACK_FAILOVER = "failover"
DEFAULT_MAX_RESUMES = 2
PrecisionListener = Callable[[str, str, int, int], None]  # rid, worker, predicted, actual cached tokens
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
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stable_len: int | None = None  # chat: tokens before the last user turn; None: raw completion
    priority: Priority = Priority.INTERACTIVE
    deadline: float = 0.0  # unix seconds; 0 = none
    ttft_deadline: float = 0.0  # unix seconds its first token is due by (the worker's waiting order); 0: none
    cache_key: str | None = None  # the client's prompt_cache_key: routes instead of the prefix, within `ns`
    fkey: bytes = b""  # fairness key: `fairness_key(...)` of the tenant; empty: the worker uses `ns`
    weight: float = 1.0  # the tenant's fair-share weight
    # a stream carried on from a lost gateway: the tokens it streamed, and the cached tokens it reported
    streamed: list[int] = field(default_factory=list)
    first_cached: int | None = None


@dataclass(slots=True)
class Routed:
    """A request with its worker chosen (`choice`), and the prefix key and holdings it was chosen by."""

    req: RouteRequest
    key: bytes | None
    span: int  # prompt tokens the worker holds under `key` once it has prefilled the request
    matched: dict[str, int]  # the prompt tokens each worker reports holding
    choice: Choice


class Router:
    """Prefix-aware, load-bounded routing over a Membership; one per gateway process."""

    def __init__(self, membership: Membership, *, secret: bytes, block_size: int = DEFAULT_BLOCK_SIZE,
                 route_prefix_tokens: int = DEFAULT_ROUTE_PREFIX_TOKENS,
                 max_stream_seconds: float = DEFAULT_MAX_STREAM_S, max_resumes: int = DEFAULT_MAX_RESUMES,
                 epsilon: float = DEFAULT_EPSILON, footprint_epsilon: float = DEFAULT_FOOTPRINT_EPSILON,
                 rng: random.Random | None = None, tokenizer_version: str | None = None,
                 class_pools: dict[Priority, str] | None = None, disagg: DisaggRule | None = None) -> None:
        if not secret:
            raise ValueError("secret must be non-empty bytes")
        self.membership = membership
        self.secret = secret
        self.block_size = block_size
        self.route_prefix_tokens = route_prefix_tokens
        self.max_stream_seconds = max_stream_seconds
        self.max_resumes = max_resumes  # times one stream may carry on elsewhere after tokens were streamed
        self.policy = RoutingPolicy(epsilon=epsilon, footprint_epsilon=footprint_epsilon, rng=rng)
        self.class_pools = class_pools or {}  # priority class -> the worker pool label it prefers
        self.loads = LoadTracker()
        self.holders = PrefixHolders()
        self.sending = InFlightPrefixes()  # this gateway's placements not yet reported by their workers
        self.kv = KvView(block_size=block_size, tokenizer_version=tokenizer_version, clock=membership.clock,
                         request_sync=lambda mid: membership.client(mid).request_sync())
        # prefill-role workers: off the ring, never sent a gen; offered to decode workers for long prefills
        self.disagg = Disaggregation(membership, disagg or DisaggRule(), self.kv.refused)
        self._precision: list[PrecisionListener] = []
        membership.on_join(self._joined)
        membership.on_leave(self._left)
        membership.on_stats(self._observed)
        self._catch_up()

    # ------------------------------------------------------------ the gateway's view

    async def start(self) -> None:
        await self.membership.start()

    async def close(self) -> None:
        await self.membership.close()

    def live(self) -> list[str]:
        """Workers that may take new requests now (prefill-role workers take none)."""
        pf = self.disagg.ids
        return [w for w in self.membership.live() if not self.kv.refused(w) and w not in pf]

    def reporting(self) -> list[Member]:
        """Workers with current stats, live or draining (what capacity admission counts), not prefill-role."""
        pf = self.disagg.ids
        return [m for m in self.membership.reporting()
                if not self.kv.refused(m.member_id) and m.member_id not in pf]

    def member_ids(self) -> list[str]:
        """Known workers that take requests while live: all members but the prefill-role ones (the ring's)."""
        return sorted(self.policy.members)

    def on_precision(self, listener: PrecisionListener) -> None:
        """Call `listener(rid, worker, predicted, actual)` with each request's cached tokens, predicted and
        reported."""
        self._precision.append(listener)

    def committed(self, worker_id: str) -> float:
        """KV tokens committed on `worker_id`, counting a request's hit only once the worker reports it."""
        return self.loads.committed(worker_id)

    def on_stats(self, listener: StatsListener) -> None:
        """Call `listener(event)` after every worker stats frame, once the router has taken it in."""
        self.membership.on_stats(listener)

    # ------------------------------------------------------------ membership events

    def _catch_up(self) -> None:
        """Take in the members (and their latest stats) known before this router subscribed."""
        for mid in self.membership.member_ids():
            self._joined(mid)
            member = self.membership.member(mid)
            if member is not None and member.stats is not None and member.stats_at is not None:
                self._observed(StatsEvent(mid, member.stats, member.stats_at))

    def _joined(self, mid: str) -> None:
        self.disagg.place(mid, member_role(self.membership.member(mid)), self.policy)  # prefill: off the ring

    def _left(self, mid: str) -> None:
        self.policy.remove(mid)
        self.disagg.forget(mid)
        self.loads.forget(mid)
        self.holders.forget(mid)
        self.kv.forget(mid)
        routing_metrics.forget_worker(mid)

    def _observed(self, event: StatsEvent) -> None:
        mid, stats = event.member_id, event.stats
        if self.disagg.place(mid, stats.role, self.policy):  # a role change moved it on or off the ring
            self.holders.clear()  # every key returns to its ring position, as when a worker joins
        self.holders.set_capacity(mid, stats.kv_total)
        self.loads.on_stats(mid, stats, event.at)
        self.kv.observe(mid, stats)
        routing_metrics.PREFIX_HIT_RATE.labels(mid).set(stats.hit_rate)
        routing_metrics.OUTSTANDING_TOKENS.labels(mid).set(self.loads.load(mid))
        if event.came_back:
            # A worker joined or came back: every key returns to its ring position (the keys that
            # must move, move), rather than staying with whichever worker took it meanwhile.
            self.holders.clear()

    # ------------------------------------------------------------ routing

    def key_for(self, req: RouteRequest) -> bytes | None:
        if req.cache_key is not None:
            return cache_key_route(req.ns, self.secret, req.cache_key)
        return prefix_key(req.tokens, req.stable_len, root=req.ns, block_size=self.block_size,
                          max_tokens=self.route_prefix_tokens)

    def pick(self, key: bytes | None, cost: int, exclude: frozenset[str] = frozenset(), span: int = 0,
             matched: dict[str, int] | None = None) -> Choice:
        """Choose a worker (raises NoWorkerAvailable) and count the fallback, if any. `matched`: the prompt
        tokens each worker reports holding (`KvView.matched`)."""
        choice = self.policy.choose(self._candidates(key, exclude, matched or {}), cost, span)
        if choice.fallback is not None:
            routing_metrics.FALLBACKS.labels(choice.fallback).inc()
        return choice

    def _pick_in_class(self, key: bytes | None, req: RouteRequest, exclude: frozenset[str], span: int,
                       matched: dict[str, int]) -> Choice:
        """`pick` within the pool of the request's priority class, spilling to every worker when the pool's
        choice is over the load bound (or the pool has none usable)."""
        label = self.class_pools.get(req.priority)
        pool_of = getattr(self.membership, "pool_of", None)
        others = outside_pool(self.policy.members, pool_of, label) if label and pool_of is not None else None
        if others:
            try:
                choice = self.pick(key, req.cost, exclude | others, span, matched)
                usable = [w for w in self.live() if w not in exclude]
                if not over_bound(choice.worker_id, usable, self.loads.loads(), req.cost,
                                  self.policy.bounds.epsilon):
                    return choice
            except NoWorkerAvailable:
                pass
            routing_metrics.FALLBACKS.labels(SPILL).inc()
        return self.pick(key, req.cost, exclude, span, matched)

    def _candidates(self, key: bytes | None, exclude: frozenset[str], matched: dict[str, int]) -> Candidates:
        order = self.policy.order(key)
        status = {w: FALLBACK_INCOMPATIBLE if self.kv.refused(w) else self.membership.status(w)
                  for w in order}
        held = beyond_common(matched, order)
        for w, tokens in self.sending.held(key).items():  # in flight here: held soon, maybe not yet reported
            held[w] = max(held.get(w, 0), tokens)
        if key is None and not held:  # keyless: least loaded, no holders or footprints to compute
            return Candidates(order, status, self.loads.loads(), keyed=False, excluded=exclude)
        return Candidates(order, status, self.loads.loads(), excluded=exclude,
                          held=held or self.holders.held(key), footprints=self._footprints_over_allowance())

    def _footprints_over_allowance(self) -> dict[str, float]:
        """Prefix tokens placed on each worker beyond FREE_FOOTPRINT_SHARE of its KV cache: the larger of what
        this gateway placed (known at once) and what the worker reports storing (all gateways' placements)."""
        holders = self.holders
        placed = holders.footprints()
        for wid, tokens in self.kv.footprints.footprints().items():
            placed[wid] = max(placed.get(wid, 0.0), tokens)
        return {wid: max(0.0, tokens - FREE_FOOTPRINT_SHARE * holders.capacity(wid))
                for wid, tokens in placed.items()}

    def route(self, req: RouteRequest) -> Routed:
        """Choose the request's worker now; raises NoWorkerAvailable. `stream` then runs it there."""
        if req.cost < 0:
            raise ValueError("cost must be >= 0")
        key = self.key_for(req)
        # what a worker holds under `key` once it has prefilled this request
        span = key_span(req.tokens, req.stable_len, block_size=self.block_size,
                        max_tokens=self.route_prefix_tokens)
        matched = self.kv.matched(req.ns, req.tokens, self.policy.members | self.disagg.ids)
        choice = self._pick_in_class(key, req, frozenset(), span, matched)
        # counted at once: the next request routed before this one's stream starts sees its load
        self.loads.add(choice.worker_id, req.rid, req.cost, self.membership.clock(),
                       self._predicted_cached(choice.worker_id, key, matched))
        return Routed(req, key, span, matched, choice)

    def release(self, routed: Routed) -> None:
        """End a routed request's load accounting if its stream never started (idempotent)."""
        self._settle(routed.choice.worker_id, routed.req.rid, 0)

    def _predicted_cached(self, wid: str, key: bytes | None, matched: dict[str, int]) -> int:
        """The prompt tokens the worker reported holding; else those this gateway sent it (not reported)."""
        reported = matched.get(wid)
        return reported if reported is not None else self.holders.expected_cached(wid, key)

    async def stream(self, routed: Routed | RouteRequest) -> AsyncIterator[OutItem]:
        """Yield the request's chunks from its routed worker (a RouteRequest is routed first); raises
        WorkerError, or NoWorkerAvailable before any output; carries on elsewhere after a worker loss."""
        if isinstance(routed, RouteRequest):
            routed = self.route(routed)
        req, key, span, matched = routed.req, routed.key, routed.span, routed.matched
        first_choice: Choice | None = routed.choice
        accounted = True  # `route` counted its load
        exclude: frozenset[str] = frozenset()
        failed: WorkerError | None = None
        # tokens the consumer has seen: a resumed attempt carries on after them
        streamed: list[int] = list(req.streamed)
        resumes, failed_at, first_cached = 0, 0.0, req.first_cached
        while True:
            try:
                choice = first_choice or self._pick_in_class(key, req, exclude, span, matched)
            except NoWorkerAvailable:
                if failed is not None:
                    raise failed from None
                raise
            first_choice = None
            started = False
            attempt = self._attempt(choice, req, key, span, matched, streamed, accounted)
            accounted = False
            try:
                # aclosing: a consumer that stops early closes us, and we close the attempt at once
                async with contextlib.aclosing(attempt) as chunks:
                    async for chunk in chunks:
                        if failed_at:
                            routing_metrics.RESUME_GAP.observe(time.monotonic() - failed_at)
                            failed_at = 0.0
                        started = True
                        if first_cached is None:
                            first_cached = chunk.cached_tokens
                        chunk.cached_tokens = first_cached  # usage as if the stream had not moved
                        streamed.extend(chunk.tokens)
                        yield chunk
                return
            except WorkerError as err:
                overdue = req.deadline > 0 and time.time() >= req.deadline
                if started or streamed:
                    reason = resume_reason(err)
                    if reason is None or resumes >= self.max_resumes or overdue:
                        raise
                    resumes += 1
                    failed_at = time.monotonic()
                    routing_metrics.RESUMES.labels(reason).inc()
                elif not err.retryable or failed is not None or overdue:
                    raise
                else:
                    failed = err
                    routing_metrics.FALLBACKS.labels(FALLBACK_FAILOVER).inc()
                if err.code != ErrorCode.ABANDONED:  # that worker is fine: it gave up on our silence
                    exclude = exclude | {choice.worker_id}

    async def _attempt(self, choice: Choice, req: RouteRequest, key: bytes | None, span: int,
                       matched: dict[str, int], streamed: list[int],
                       accounted: bool) -> AsyncIterator[OutItem]:
        wid = choice.worker_id
        m = self.membership
        client = m.client(wid)
        loads, holders = self.loads, self.holders
        loop = asyncio.get_running_loop()
        hard_deadline = loop.time() + self._time_left(req)
        predicted = self._predicted_cached(wid, key, matched)
        if not accounted:  # `route` counted the first choice's load
            loads.add(wid, req.rid, req.cost, m.clock(), predicted)
        # Once this request is prefilled the worker holds its prefix: a request with the same key sent
        # there meanwhile waits for those pages instead of recomputing them (DESIGN.md, worker engine).
        holders.remember(wid, key, span)
        self.sending.add(key, wid, span)
        routing_metrics.REQUESTS.labels(wid).inc()
        routing_metrics.OUTSTANDING_TOKENS.labels(wid).set(loads.load(wid))
        tokens = with_streamed(req.tokens, streamed) if streamed else req.tokens
        hint = self.disagg.choose(req.rid, token_count(tokens) - predicted, matched)  # afresh per attempt
        stream = client.generate(req.rid, req.ns, tokens, req.sampling, req.priority, req.deadline,
                                 fkey=req.fkey, weight=req.weight, resumed=len(streamed), prefill=hint,
                                 ttft_deadline=0.0 if streamed else req.ttft_deadline,
                                 traceparent=routing_metrics.route_span(choice, predicted, len(streamed),
                                                                        hint))
        first = True
        cached = 0
        try:
            # Each wait inside is bounded by the client's inter-token timeout and worker-loss check;
            # the request's own deadline is checked per chunk (a timeout context would fire in the
            # consumer's code while this generator is suspended at `yield`).
            async for chunk in stream:
                if first:
                    first = False
                    self.disagg.done(hint, req.rid)  # the prefill worker's part is over
                    loads.first_output(wid, req.rid, m.clock(), chunk.cached_tokens)
                    self._predicted(req.rid, wid, predicted, chunk.cached_tokens)
                    if chunk.cached_tokens > span:
                        holders.remember(wid, key, chunk.cached_tokens)
                cached = max(cached, chunk.cached_tokens)
                if loop.time() > hard_deadline:
                    raise WorkerError("timeout", "request deadline passed", True)
                if chunk.finish_reason is not None:
                    # settle now: a consumer may stop iterating at the final chunk and never close us
                    self._settle(wid, req.rid, cached)
                    cached = 0
                yield chunk
        finally:
            self.sending.remove(key, wid)
            self.disagg.done(hint, req.rid)
            self._settle(wid, req.rid, cached)
            await stream.aclose()  # sends abort when the stream did not finish

    def _predicted(self, rid: str, wid: str, predicted: int, actual: int) -> None:
        if predicted > 0:
            routing_metrics.PREDICTED_TOKENS.labels(wid).inc(predicted)
            routing_metrics.PRECISION.observe(min(predicted, actual) / predicted)
        for listener in self._precision:
            listener(rid, wid, predicted, actual)

    def _settle(self, wid: str, rid: str, cached: int) -> None:
        """End the request's load accounting (idempotent)."""
        loads = self.loads
        loads.release(wid, rid)
        if wid in self.policy:
            routing_metrics.OUTSTANDING_TOKENS.labels(wid).set(loads.load(wid))
            if cached:
                routing_metrics.CACHED_TOKENS.labels(wid).inc(cached)

    def _time_left(self, req: RouteRequest) -> float:
        if req.deadline <= 0:
            return self.max_stream_seconds
        return max(0.0, min(req.deadline - time.time() + DEADLINE_GRACE_S, self.max_stream_seconds))
