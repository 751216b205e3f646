"""Router.stream failover rules against scripted peers on real ZeroMQ sockets speaking the wire protocol.

Each peer is a ROUTER socket that sends `stats` every 50 ms and answers `gen` per
its script: stream tokens, fail (retryable or not), or die (stop all frames)
before or after the first token. The router must re-send once before the first
token, end with a retryable error after it, and never hang or leak accounting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq
import zmq.asyncio
from prometheus_client import REGISTRY

from router import (
    FALLBACK_FOOTPRINT,
    Choice,
    Membership,
    NoWorkerAvailable,
    Router,
    RouteRequest,
    WorkerError,
    namespace_root,
)
from tests.conftest import free_port
from worker import protocol as proto
from worker.protocol import SamplingParams

SECRET = b"dispatch-secret"
NS = namespace_root("m", "v", "tenant", SECRET)


class ScriptedWorker:
    def __init__(self, name: str, script: str) -> None:
        self.name = name
        self.script = script
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.gens: list[str] = []
        self.requests: list[proto.GenRequest] = []
        self.aborts: list[str] = []
        self.dead = False
        self.draining = False
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._peers: set[bytes] = set()
        self._tasks = [asyncio.create_task(self._recv()), asyncio.create_task(self._stats())]

    def die(self) -> None:
        """Stop answering and close the socket, as a dead process does (the gateway sees the link go down)."""
        self.dead = True
        asyncio.get_running_loop().call_soon(self._sock.close, 0)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await t
        self._sock.close()
        self._ctx.term()

    def _stats_frame(self) -> bytes:
        return proto.encode_stats(proto.WorkerStats(
            worker_id=self.name, queue=0, running=len(self.gens), kv_free=1000, kv_total=1000, hit_rate=0.0,
            draining=self.draining, model="m", version=proto.PROTOCOL_VERSION))

    async def _stats(self) -> None:
        while not self.dead:
            await asyncio.sleep(0.05)
            if not self.dead:
                for peer in self._peers:
                    await self._sock.send_multipart([peer, self._stats_frame()])

    async def _recv(self) -> None:
        while not self.dead:
            ident, data = await self._sock.recv_multipart()
            self._peers.add(ident)
            if self.dead:
                continue
            msg = proto.decode_gateway_frame(data, 100_000)
            if isinstance(msg, proto.Abort):
                self.aborts.append(msg.rid)
            elif isinstance(msg, proto.GenRequest):
                self.gens.append(msg.rid)
                self.requests.append(msg)
                await self._answer(ident, msg.rid, msg.resumed)

    async def _answer(self, ident: bytes, rid: str, resumed: int = 0) -> None:
        def out(tokens: list[int], finish: str | None) -> bytes:
            return proto.encode_out([proto.OutItem(rid, tokens, finish, 16, None)])

        if self.script == "ok":  # tokens 1, 2, 3; a resumed request carries on after the ones it was sent
            rest = [1, 2, 3][resumed:]
            if rest[:-1]:
                await self._sock.send_multipart([ident, out(rest[:-1], None)])
            await self._sock.send_multipart([ident, out(rest[-1:], "length")])
        elif self.script == "retryable":
            await self._sock.send_multipart([ident, proto.encode_err(rid, "capacity", "full", True)])
        elif self.script == "fatal":
            await self._sock.send_multipart([ident, proto.encode_err(rid, "bad_request", "nope", False)])
        elif self.script == "die_before_first":
            self.die()
        elif self.script == "stall_after_first":
            await self._sock.send_multipart([ident, out([1], None)])
        elif self.script == "die_after_first":
            await self._sock.send_multipart([ident, out([1], None)])
            self.die()
        elif self.script == "abandon_after_first":  # gave up on a silent gateway once, then serves as usual
            self.script = "ok"
            await self._sock.send_multipart([ident, out([1], None)])
            await self._sock.send_multipart([ident,
                                             proto.encode_err(rid, "abandoned", "gateway silent", True)])


@contextlib.asynccontextmanager
async def setup(first: str, second: str):
    """Two scripted workers; yields (router, request whose home is the `first` one, workers)."""
    a, b = ScriptedWorker("a", first), ScriptedWorker("b", second)
    membership = Membership(gateway_id="gw-dispatch", static_endpoints=[a.endpoint, b.endpoint],
                            poll_interval=60, dead_after=0.3)
    try:
        await membership.start()
        await membership.wait_until(lambda m: len(m.live()) == 2, timeout=10)
        router = Router(membership, secret=SECRET)
        for p in range(500):
            req = RouteRequest(rid=f"r{p}", ns=NS, tokens=[p] * 32, cost=40,
                               sampling=SamplingParams(max_tokens=3), deadline=time.time() + 30)
            if router.policy.order(router.key_for(req))[0] == a.endpoint:
                break
        yield router, req, a, b
    finally:
        await membership.close()
        await a.close()
        await b.close()


async def collect(router: Router, req: RouteRequest) -> list[int]:
    tokens: list[int] = []
    async with contextlib.aclosing(router.stream(req)) as chunks:
        async for chunk in chunks:
            tokens += chunk.tokens
    return tokens


def no_inflight(router: Router) -> bool:
    return all(router.loads.inflight_count(w) == 0 for w in router.membership.member_ids())


async def test_a_sent_prefix_counts_as_held_by_its_worker() -> None:
    async with setup("stall_after_first", "ok") as (router, req, a, b):
        loads = router.loads
        key = router.key_for(req)
        assert router.holders.expected_cached(a.endpoint, key) == 0
        first = router.stream(req)
        chunk = await asyncio.wait_for(anext(first), 10)  # a answered with cached_tokens 16
        assert chunk.tokens == [1]
        # the key's span: the whole 32-token prompt
        assert router.holders.expected_cached(a.endpoint, key) == 32
        assert router.holders.expected_cached(b.endpoint, key) == 0
        # what the footprint rule balances for new prefixes
        assert router.holders.footprints() == {a.endpoint: 32}
        assert loads.load(a.endpoint) == 40 - 16
        await first.aclose()
        again = RouteRequest(rid="again", ns=NS, tokens=req.tokens, cost=40,
                             sampling=SamplingParams(max_tokens=3), deadline=time.time() + 30)
        second = router.stream(again)
        await asyncio.wait_for(anext(second), 10)
        assert a.gens == [req.rid, "again"]
        await second.aclose()
        assert no_inflight(router)


async def test_a_new_prefix_passes_a_home_filled_beyond_its_allowance() -> None:
    async with setup("ok", "ok") as (router, req, a, b):
        key = router.key_for(req)
        # within a quarter of a's 1000-token cache: no preference
        router.holders.remember(a.endpoint, b"x" * 16, 200)
        assert router.pick(key, 40, span=32) == Choice(a.endpoint)
        router.holders.remember(a.endpoint, b"y" * 16, 200)  # 150 tokens beyond it, b has none
        assert router.pick(key, 40, span=32) == Choice(b.endpoint, FALLBACK_FOOTPRINT)


async def test_home_worker_serves() -> None:
    async with setup("ok", "ok") as (router, req, a, b):
        assert await asyncio.wait_for(collect(router, req), 10) == [1, 2, 3]
        assert a.gens == [req.rid] and b.gens == []
        assert no_inflight(router)


@pytest.mark.parametrize("script", ["retryable", "die_before_first"])
async def test_failure_before_first_token_fails_over_once(script: str) -> None:
    async with setup(script, "ok") as (router, req, a, b):
        assert await asyncio.wait_for(collect(router, req), 10) == [1, 2, 3]
        assert a.gens == [req.rid] and b.gens == [req.rid]
        assert no_inflight(router)


async def test_second_failure_is_returned_not_retried_again() -> None:
    async with setup("retryable", "retryable") as (router, req, a, b):
        with pytest.raises(WorkerError) as err:
            await asyncio.wait_for(collect(router, req), 10)
        assert err.value.retryable and err.value.code == "capacity"
        assert len(a.gens) + len(b.gens) == 2
        assert no_inflight(router)


async def test_non_retryable_error_is_not_retried() -> None:
    async with setup("fatal", "ok") as (router, req, a, b):
        with pytest.raises(WorkerError) as err:
            await asyncio.wait_for(collect(router, req), 10)
        assert not err.value.retryable
        assert b.gens == []


async def test_death_after_first_token_resumes_on_another_worker() -> None:
    async with setup("die_after_first", "ok") as (router, req, a, b):
        got: list[int] = []
        async with contextlib.aclosing(router.stream(req)) as chunks:
            async for chunk in chunks:
                got += chunk.tokens
        assert got == [1, 2, 3]  # one uninterrupted stream
        (resumed,) = b.requests
        assert resumed.resumed == 1 and resumed.tokens.tolist() == list(req.tokens) + [1]
        assert no_inflight(router)


async def test_a_worker_that_gave_up_on_a_stalled_gateway_carries_the_stream_on() -> None:
    """`abandoned` (the worker stopped waiting for this gateway while its loop stalled) resumes the stream,
    and may resume it on the same worker, which is healthy."""
    async with setup("abandon_after_first", "ok") as (router, req, a, b):
        b.die()  # the only other worker is gone: the resume must be allowed back on a
        await router.membership.wait_until(lambda m: m.live() == [a.endpoint], timeout=5)
        assert await asyncio.wait_for(collect(router, req), 10) == [1, 2, 3]
        assert [r.resumed for r in a.requests] == [0, 1] and no_inflight(router)


async def test_death_after_first_token_without_resumes_ends_with_retryable_error() -> None:
    async with setup("die_after_first", "ok") as (router, req, a, b):
        router.max_resumes = 0
        got: list[int] = []
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as err:
            async with contextlib.aclosing(router.stream(req)) as chunks:
                async for chunk in chunks:
                    got += chunk.tokens
        assert got == [1]
        assert err.value.retryable
        assert time.monotonic() - t0 < 5  # detected by missing stats, not a long timeout
        assert b.gens == []  # never re-sent after output
        assert no_inflight(router)


async def test_resumes_stop_at_the_limit() -> None:
    async with setup("die_after_first", "die_after_first") as (router, req, a, b):
        router.max_resumes = 1  # a dies after token 1; b gets it resumed, dies after its first token too
        got: list[int] = []
        with pytest.raises(WorkerError):
            async with contextlib.aclosing(router.stream(req)) as chunks:
                async for chunk in chunks:
                    got += chunk.tokens
        assert got == [1, 1] and b.requests[0].resumed == 1
        assert no_inflight(router)


async def test_draining_and_dead_workers_take_nothing() -> None:
    async with setup("ok", "ok") as (router, req, a, b):
        a.draining = True
        await router.membership.wait_until(lambda m: m.status(a.endpoint) == "draining", timeout=5)
        assert await asyncio.wait_for(collect(router, req), 10) == [1, 2, 3]
        assert a.gens == [] and b.gens == [req.rid]
        b.die()
        await router.membership.wait_until(lambda m: m.live() == [], timeout=5)
        req.rid = "another"
        with pytest.raises(NoWorkerAvailable):
            await collect(router, req)


async def test_consumer_leaving_early_aborts_and_releases() -> None:
    async with setup("stall_after_first", "ok") as (router, req, a, b):
        async with contextlib.aclosing(router.stream(req)) as chunks:
            async for _ in chunks:
                break
        assert no_inflight(router)  # released synchronously on close
        deadline = time.monotonic() + 5
        while a.aborts != [req.rid] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert a.aborts == [req.rid]


async def test_metrics_count_per_worker_and_drop_departed_workers() -> None:
    def sample(name: str, labels: dict[str, str]) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    async with setup("retryable", "ok") as (router, req, a, b):
        failovers = sample("switchyard_router_fallbacks_total", {"reason": "failover"}) or 0.0
        assert await asyncio.wait_for(collect(router, req), 10) == [1, 2, 3]
        assert sample("switchyard_router_requests_total", {"worker": a.endpoint}) == 1.0
        assert sample("switchyard_router_requests_total", {"worker": b.endpoint}) == 1.0
        assert sample("switchyard_router_fallbacks_total", {"reason": "failover"}) == failovers + 1
        assert sample("switchyard_router_cached_tokens_total", {"worker": b.endpoint}) == 16.0
        assert sample("switchyard_router_outstanding_tokens", {"worker": b.endpoint}) == 0.0
        assert sample("switchyard_router_prefix_hit_rate", {"worker": a.endpoint}) == 0.0
    # membership closed: every per-worker series is gone (bounded label sets)
    for name in ("switchyard_router_requests_total", "switchyard_router_outstanding_tokens",
                 "switchyard_router_prefix_hit_rate"):
        assert sample(name, {"worker": a.endpoint}) is None


async def test_traced_request_records_its_route_and_hands_the_worker_its_context(spans) -> None:
    """With tracing on, a `route` span (worker, reason, predicted cached tokens) is a child of the request's
    span, and the `gen` frame carries its traceparent, so the worker's spans join the same trace."""
    from opentelemetry import trace

    from common.trace_context import tracer

    async with setup("ok", "ok") as (router, req, a, b):
        with tracer("test").start_as_current_span("request") as parent:
            assert await asyncio.wait_for(collect(router, req), 10) == [1, 2, 3]
        trace_id = parent.get_span_context().trace_id
    (route,) = [s for s in spans.get_finished_spans() if s.name == "route"]
    assert route.parent.span_id == parent.get_span_context().span_id and route.context.trace_id == trace_id
    assert (route.attributes["switchyard.worker"] == a.endpoint
            and route.attributes["switchyard.route.reason"] == "home")
    assert "switchyard.route.predicted_cached_tokens" in route.attributes
    (sent,) = a.requests
    assert sent.traceparent[:52] == f"00-{trace_id:032x}-{route.context.span_id:016x}"
    assert int(sent.traceparent[53:], 16) & 1  # sampled
    assert trace.get_current_span() is trace.INVALID_SPAN


async def test_untraced_request_sends_no_traceparent() -> None:
    async with setup("ok", "ok") as (router, req, a, b):
        await asyncio.wait_for(collect(router, req), 10)
    (sent,) = a.requests
    assert sent.traceparent == ""


async def test_requests_routed_before_their_streams_start_spread_by_load() -> None:
    """`route` counts the load at once: requests routed back to back (their streams not started yet, as the
    gateway routes at admission) do not all pick the same least-loaded worker."""
    async with setup("ok", "ok") as (router, _, a, b):
        routed = [router.route(RouteRequest(rid=f"k{i}", ns=NS, tokens=[7, 8, 9], cost=40,
                                            sampling=SamplingParams(max_tokens=3))) for i in range(8)]
        picked = [r.choice.worker_id for r in routed]
        assert picked.count(a.endpoint) == picked.count(b.endpoint) == 4, picked
        for r in routed[:4]:  # streamed to the end: released by the stream
            async with contextlib.aclosing(router.stream(r)) as chunks:
                assert [t async for c in chunks for t in c.tokens] == [1, 2, 3]
        for r in routed:  # the rest never started: released here; twice is harmless
            router.release(r)
        assert no_inflight(router)
