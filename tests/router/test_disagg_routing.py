"""Disaggregated prefill through the Router: prefill-role workers never take a gen nor
count for capacity, each attempt decides afresh, the hint reaches the wire, the
in-flight count follows each prefill, and the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest
import zmq.asyncio
from prometheus_client import REGISTRY

from router import Membership, Router, RouteRequest
from router.disagg.prefill_target import DisaggRule
from router.links.client import LinkError, WorkerClient, WorkerError
from tests.router.test_router_client import Peer
from tests.router.test_router_dispatch import ScriptedWorker
from tests.router.test_router_kv_index import NS, FakeClient, report, stats
from worker import protocol as p
from worker.protocol import PrefillHint, SamplingParams, block_ids


class GenClient(FakeClient):
    """FakeClient that also streams: records each gen's prefill hint, answers one token once `gate` is set (a
    second one once `more` is set, when `two` is), or fails retryably before any token when `fail` is set."""

    def __init__(self, endpoint: str, **kw: object) -> None:
        super().__init__(endpoint, **kw)
        self.hints: list[PrefillHint | None] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False
        self.two = False
        self.more = asyncio.Event()

    async def generate(self, rid, ns, tokens, sampling, priority, deadline, *, prefill=None,
                       **_):  # noqa: ANN001, ANN202
        self.hints.append(prefill)
        await self.gate.wait()
        if self.fail:
            raise WorkerError(LinkError.TIMEOUT, "no tokens", True)
        if self.two:
            yield p.OutItem(rid, [6], None, 0, None)
            await self.more.wait()
        yield p.OutItem(rid, [7], "length", 0, None)


async def fleet(roles: dict[str, str], rule: DisaggRule | None = None, **kw) -> Router:
    """A Router over fake workers `name -> role`, each with one stats frame (extra stats fields in `kw`)."""
    m = Membership(gateway_id="gw", static_endpoints=list(roles), client_factory=GenClient)
    await m.refresh()
    router = Router(m, secret=b"secret", tokenizer_version="tok-1", rng=random.Random(1), disagg=rule)
    for wid, role in roles.items():
        m.observe(wid, stats(wid, None, role=role, **kw.get(wid, {})))
    return router


def sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def counts() -> dict[str, float]:
    out = {o: sample("switchyard_disagg_requests_total", {"outcome": o}) for o in ("remote", "local")}
    for r in ("short", "no_prefill_worker", "prefill_queue"):
        out[r] = sample("switchyard_disagg_fallbacks_total", {"reason": r})
    return out


def delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counts().items() if v != before[k]}


def request(rid: str, n: int, seed: int = 0) -> RouteRequest:
    rng = random.Random(seed)
    return RouteRequest(rid, NS, [rng.randrange(100, 30000) for _ in range(n)], n + 8,
                        sampling=SamplingParams(max_tokens=8), deadline=time.time() + 30)


async def run(router: Router, req: RouteRequest) -> list[int]:
    out: list[int] = []
    async with contextlib.aclosing(router.stream(req)) as chunks:
        async for chunk in chunks:
            out += chunk.tokens
    return out


def client(router: Router, wid: str) -> GenClient:
    return router.membership.client(wid)  # type: ignore[return-value]


async def test_prefill_workers_take_no_gen_and_count_for_no_capacity() -> None:
    router = await fleet({"a": "both", "d": "decode", "p": "prefill"})
    assert router.live() == ["a", "d"]
    assert [m.member_id for m in router.reporting()] == ["a", "d"]
    assert router.policy.members == {"a", "d"}
    assert router.member_ids() == ["a", "d"]  # what the gateway reads pool labels from (capacity gates)
    fallbacks = {r: sample("switchyard_router_fallbacks_total", {"reason": r})
                 for r in ("dead", "excluded", "draining", "load", "holder", "footprint")}
    picks = {router.pick(router.key_for(request(f"k{i}", 64, seed=i)), 72).worker_id for i in range(300)}
    assert picks == {"a", "d"}
    # no key's walk starts at the prefill worker: no fallback is counted for it
    assert fallbacks == {r: sample("switchyard_router_fallbacks_total", {"reason": r}) for r in fallbacks}


async def test_a_role_change_moves_a_worker_on_or_off_the_ring() -> None:
    router = await fleet({"a": "both", "b": "both"})
    m = router.membership
    router.holders.remember("a", b"k" * 16, 64)
    m.observe("b", stats("b", None, role="prefill"))
    assert router.live() == ["a"] and router.policy.members == {"a"} and router.disagg.ids == {"b"}
    assert router.holders.expected_cached("a", b"k" * 16) == 0  # the ring changed: learned homes are dropped
    m.observe("b", stats("b", None, role="decode"))
    assert router.live() == ["a", "b"] and router.policy.members == {"a", "b"} and router.disagg.ids == set()
    await m.close()
    assert router.disagg.ids == set() and router.policy.members == frozenset()


async def test_a_long_prompt_is_prefilled_on_the_prefill_worker_and_the_hint_is_sent() -> None:
    router = await fleet({"d": "decode", "p": "prefill"})
    before = counts()
    assert await run(router, request("r1", 600)) == [7]
    assert client(router, "d").hints == [PrefillHint("p", "p")]  # the static endpoint is its id
    assert client(router, "p").hints == []
    assert delta(before) == {"remote": 1.0}
    assert router.disagg.inflight("p") == 0


async def test_a_short_prompt_or_a_held_prefix_stays_local() -> None:
    router = await fleet({"d": "decode", "p": "prefill"})
    before = counts()
    await run(router, request("short", 500))
    req = request("held", 1000, seed=3)
    # d reports holding 40 of the prompt's blocks (640 tokens): it lacks 360 < 512
    router.membership.observe("d", stats("d", report(0, block_ids(NS, req.tokens, 16)[:40], snapshot=True),
                                               role="decode"))
    await run(router, req)
    assert client(router, "d").hints == [None, None]
    assert delta(before) == {"local": 2.0, "short": 2.0}


async def test_busy_or_dead_prefill_workers_leave_the_prefill_local_with_its_reason() -> None:
    router = await fleet({"d": "decode", "p": "prefill"}, p={"queue": 3, "running": 2})  # 5 > 4: busy
    before = counts()
    await run(router, request("busy", 2000))
    router.membership.observe("p", stats("p", None, role="prefill", draining=True))
    await run(router, request("gone", 2000))
    assert client(router, "d").hints == [None, None]
    assert delta(before) == {"local": 2.0, "prefill_queue": 1.0, "no_prefill_worker": 1.0}


async def test_without_prefill_workers_nothing_changes_and_no_fallback_is_counted() -> None:
    router = await fleet({"a": "both", "b": "both"})
    before = counts()
    await run(router, request("r", 4000))
    assert client(router, "a").hints + client(router, "b").hints == [None]
    assert delta(before) == {"local": 1.0}


async def test_the_prefill_worker_holding_the_prompt_is_chosen() -> None:
    router = await fleet({"d": "decode", "p1": "prefill", "p2": "prefill"}, p2={"queue": 2})
    req = request("r", 2000, seed=5)
    router.membership.observe("p2", stats("p2", report(0, block_ids(NS, req.tokens, 16)[:10], snapshot=True),
                                                role="prefill", queue=2))
    await run(router, req)
    assert client(router, "d").hints == [PrefillHint("p2", "p2")]  # holds 160 tokens; its queue is longer
    await run(router, request("other", 2000, seed=6))
    assert client(router, "d").hints[-1] == PrefillHint("p1", "p1")  # holds nothing: the shorter queue


async def test_a_remote_prefill_is_in_flight_until_the_first_output() -> None:
    router = await fleet({"d": "decode", "p": "prefill"},
                         rule=DisaggRule(min_tokens=512, max_prefill_queue=0))
    d = client(router, "d")
    d.gate.clear()
    first = asyncio.create_task(run(router, request("r1", 1000)))
    await asyncio.sleep(0.01)
    assert router.disagg.inflight("p") == 1  # sent, no output yet
    second = asyncio.create_task(run(router, request("r2", 1000, seed=1)))
    await asyncio.sleep(0.01)
    assert d.hints == [PrefillHint("p", "p"), None]  # p counts as busy while r1's prefill is unacknowledged
    d.gate.set()
    assert await first == [7] and await second == [7]
    assert router.disagg.inflight("p") == 0
    third = asyncio.create_task(run(router, request("r3", 1000, seed=2)))
    assert await third == [7] and d.hints[-1] == PrefillHint("p", "p")  # acknowledged: p takes prefills again


async def test_the_first_output_acknowledges_the_prefill_before_the_stream_ends() -> None:
    router = await fleet({"d": "decode", "p": "prefill"})
    d = client(router, "d")
    d.two = True
    async with contextlib.aclosing(router.stream(request("r", 1000))) as chunks:
        assert (await anext(chunks)).tokens == [6]
        assert router.disagg.inflight("p") == 0  # decoding on d now: p's part is over
        d.more.set()
        assert (await anext(chunks)).tokens == [7]
    assert d.hints == [PrefillHint("p", "p")]


async def test_an_attempt_that_ends_without_output_releases_its_prefill() -> None:
    router = await fleet({"d": "decode", "p": "prefill"})
    client(router, "d").fail = True
    with pytest.raises(WorkerError):
        await run(router, request("r", 1000))  # no other decode worker to fail over to
    assert client(router, "d").hints == [PrefillHint("p", "p")]
    assert router.disagg.inflight("p") == 0


async def test_a_failover_decides_afresh_and_releases_the_failed_attempts_prefill() -> None:
    router = await fleet({"a": "decode", "b": "decode", "p": "prefill"})
    req = request("r", 3000)
    home = router.pick(router.key_for(req), req.cost).worker_id
    other = "b" if home == "a" else "a"
    client(router, home).fail = True
    before = counts()
    assert await run(router, req) == [7]
    assert client(router, home).hints == [PrefillHint("p", "p")]
    assert client(router, other).hints == [PrefillHint("p", "p")]  # the retry's own decision
    assert delta(before) == {"remote": 2.0}
    assert router.disagg.inflight("p") == 0  # the failed attempt's prefill is not left counted


async def test_generate_puts_the_prefill_hint_on_the_wire() -> None:
    ctx = zmq.asyncio.Context()
    peer = Peer(ctx)
    c = WorkerClient(peer.endpoint, gateway_id="gw-test", context=ctx, inter_token_timeout=1.0)
    await c.start()
    try:
        ident, _ = await peer.recv("hello")
        await peer.stats(ident)
        await c.wait_ready(5.0)
        hint = PrefillHint("pf-1", "tcp://10.0.0.7:5600")
        for rid, sent in (("r1", hint), ("r2", None)):
            stream = c.generate(rid, b"ns", [1, 2, 3], SamplingParams(max_tokens=1), prefill=sent)
            task = asyncio.create_task(anext(stream))
            _, gen = await peer.recv("gen")
            assert isinstance(gen, p.GenRequest) and gen.rid == rid and gen.prefill == sent
            await peer.send(ident, p.encode_out([p.OutItem(rid, [5], "length", 0, None)]))
            assert (await asyncio.wait_for(task, 5)).tokens == [5]
            await stream.aclose()
    finally:
        await c.close()
        peer.sock.close()
        ctx.term()


async def test_the_route_span_names_the_prefill_worker(spans) -> None:  # noqa: ANN001
    router = await fleet({"d": "decode", "p": "prefill"})
    await run(router, request("remote", 1000))
    await run(router, request("local", 100))
    remote, local = [s for s in spans.get_finished_spans() if s.name == "route"]
    assert remote.attributes["switchyard.route.prefill_worker"] == "p"
    assert "switchyard.route.prefill_worker" not in local.attributes


class RoleWorker(ScriptedWorker):
    """A scripted worker whose stats frames carry a disaggregation role."""

    def __init__(self, name: str, script: str, role: str) -> None:
        super().__init__(name, script)
        self.role = role

    def _stats_frame(self) -> bytes:
        s = p.WorkerStats(worker_id=self.name, queue=0, running=0, kv_free=1000, kv_total=1000, hit_rate=0.0,
                          draining=False, model="m", version=p.PROTOCOL_VERSION)
        s.role = self.role
        return p.encode_stats(s)


async def test_over_real_sockets_the_role_comes_from_stats_and_the_decode_worker_gets_the_hint() -> None:
    dec, pf = RoleWorker("dec", "ok", "decode"), RoleWorker("pf", "ok", "prefill")
    m = Membership(gateway_id="gw-disagg", static_endpoints=[dec.endpoint, pf.endpoint], poll_interval=60,
                   dead_after=0.3)
    try:
        await m.start()
        await m.wait_until(lambda m: len(m.live()) == 2, timeout=10)
        router = Router(m, secret=b"secret", disagg=DisaggRule(min_tokens=64))
        assert router.live() == [dec.endpoint] and router.disagg.ids == {pf.endpoint}
        tokens = await asyncio.wait_for(run(router, request("r", 100)), 10)
        assert tokens == [1, 2, 3] and pf.requests == []
        (gen,) = dec.requests
        assert gen.prefill == PrefillHint(pf.endpoint, pf.endpoint)
    finally:
        await m.close()
        await dec.close()
        await pf.close()


async def test_the_gateway_settings_and_flags_reach_the_router() -> None:
    import argparse

    from pydantic import ValidationError

    from config import cmd_gateway
    from config.settings import load_settings

    parser = argparse.ArgumentParser()
    cmd_gateway.add_arguments(parser)
    args = parser.parse_args(["--disagg-min-tokens", "128", "--disagg-max-prefill-queue", "0"])
    gw = load_settings(None, cmd_gateway.overrides_from_args(args)).gateway
    assert (gw.disagg_min_tokens, gw.disagg_max_prefill_queue) == (128, 0)
    m = Membership(gateway_id="gw", static_endpoints=["d"], client_factory=GenClient)
    assert cmd_gateway._router(gw, m, "tok-1").disagg.rule == DisaggRule(128, 0)
    default = load_settings(None, {}).gateway
    assert (default.disagg_min_tokens, default.disagg_max_prefill_queue) == (512, 4)
    with pytest.raises(ValidationError):
        load_settings(None, {"gateway": {"disagg_min_tokens": 0}})
    with pytest.raises(ValidationError):
        load_settings(None, {"gateway": {"disagg_max_prefill_queue": -1}})
