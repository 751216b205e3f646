"""Membership against a real redis-server: registry watch, liveness by injected clock and by real links
(a worker thread on a real ROUTER socket), draining, Redis loss, event-loop stalls, load."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from common.worker_registry import REGISTRY_KEY_PREFIX, REGISTRY_SET_KEY, Registration, registration_key
from router import FALLBACK_DEAD, FALLBACK_DRAINING, Membership, Router
from router.placement.holders import PrefixHolders
from router.placement.load import LoadTracker
from tests.worker.server.test_worker_liveness import ThreadWorker
from worker.protocol import PROTOCOL_VERSION, WorkerStats
from worker.server.process.registry import heartbeat


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stats(wid: str, *, draining: bool = False, running: int = 0, queue: int = 0,
          version: int = PROTOCOL_VERSION) -> WorkerStats:
    return WorkerStats(worker_id=wid, queue=queue, running=running, kv_free=1000, kv_total=1000,
                       hit_rate=0.5, draining=draining, model="m", version=version)


def register(r: redis.Redis, wid: str, endpoint: str, started_at: float = 1.0, ttl_ms: int = 5000) -> None:
    heartbeat(r, Registration(wid, endpoint, "m", PROTOCOL_VERSION, started_at), ttl_ms)


@pytest.fixture()
def r(redis_url: str):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


async def test_registry_members_liveness_and_draining(redis_url: str, r: redis.Redis) -> None:
    register(r, "w1", "tcp://127.0.0.1:1")
    register(r, "w2", "tcp://127.0.0.1:2")
    r.set(REGISTRY_KEY_PREFIX + "broken", b"not json")
    r.zadd(REGISTRY_SET_KEY, {"broken": 2 ** 50})
    clock = Clock()
    m = Membership(gateway_id="gw-test", redis_url=redis_url, poll_interval=60, clock=clock, dead_after=0.5)
    router = Router(m, secret=b"s")
    await m.start()
    try:
        assert m.member_ids() == ["w1", "w2"]
        assert set(router.policy.members) == {"w1", "w2"}
        assert m.live() == []  # no stats yet: not routable
        assert m.status("w1") == FALLBACK_DEAD
        m.observe("w1", stats("w1"))
        m.observe("w2", stats("w2"))
        assert m.live() == ["w1", "w2"]
        clock.now += 0.4
        m.observe("w1", stats("w1"))
        clock.now += 0.2  # w2 silent for 0.6 s > dead_after
        assert m.live() == ["w1"]
        assert m.status("w2") == FALLBACK_DEAD
        assert "w2" in router.policy  # stays on the ring so its keys come back
        router.holders.remember("w1", b"k" * 16, 64)  # w1 took w2's key meanwhile
        m.observe("w2", stats("w2", draining=True))
        assert m.status("w2") == FALLBACK_DRAINING
        assert router.holders.expected_cached("w1", b"k" * 16) == 64  # draining is not back
        m.observe("w2", stats("w2", draining=False))
        assert router.holders.expected_cached("w1", b"k" * 16) == 64  # draining -> live: nothing came back
        clock.now += 0.6
        m.observe("w1", stats("w1"))
        m.observe("w2", stats("w2"))  # dead -> live: keys go back to their ring positions
        assert router.holders.expected_cached("w1", b"k" * 16) == 0
        m.observe("w2", stats("w2", draining=True))
        m.observe("w2", stats("w2"))
        assert m.live() == ["w1", "w2"]
        m.observe("w2", stats("w2", version=PROTOCOL_VERSION + 1))
        assert m.status("w2") == FALLBACK_DEAD

        r.delete(registration_key("w2"))
        register(r, "w3", "tcp://127.0.0.1:3")
        await m.refresh()
        assert m.member_ids() == ["w1", "w2", "w3"]  # gone from the registry, but its link is not silent
        clock.now += 0.6
        m.observe("w1", stats("w1"))
        await m.refresh()  # gone from the registry and silent past dead_after: removed
        assert m.member_ids() == ["w1", "w3"]
        assert set(router.policy.members) == {"w1", "w3"}
    finally:
        await m.close()
    assert m.member_ids() == []


async def test_restarted_worker_on_same_endpoint_collapses_to_newest(redis_url: str, r: redis.Redis) -> None:
    register(r, "old", "tcp://127.0.0.1:9", started_at=1.0)
    register(r, "new", "tcp://127.0.0.1:9", started_at=2.0)
    m = Membership(gateway_id="gw", redis_url=redis_url, static_endpoints=["tcp://127.0.0.1:9",
                                                                           "tcp://127.0.0.1:8"],
                   poll_interval=60)
    await m.start()
    try:
        # the static endpoint 9 is covered by the registry entry; 8 is static-only, named by endpoint
        assert m.member_ids() == ["new", "tcp://127.0.0.1:8"]
    finally:
        await m.close()


async def test_redis_outage_keeps_the_last_view(redis_url: str, r: redis.Redis, redis_server) -> None:
    register(r, "w1", "tcp://127.0.0.1:1")
    m = Membership(gateway_id="gw", redis_url=redis_url, poll_interval=60)
    await m.start()
    try:
        redis_server.stop()
        t0 = time.monotonic()
        await m.refresh()  # bounded by the socket timeouts, no exception
        assert time.monotonic() - t0 < 5
        assert m.member_ids() == ["w1"]
    finally:
        redis_server.start()
        await m.close()


async def test_background_poll_picks_up_new_workers(redis_url: str, r: redis.Redis) -> None:
    m = Membership(gateway_id="gw", redis_url=redis_url, poll_interval=0.05)
    await m.start()
    try:
        assert m.member_ids() == []
        register(r, "late", "tcp://127.0.0.1:4")
        await m.wait_until(lambda mm: mm.member_ids() == ["late"], timeout=3)
        r.delete(registration_key("late"))
        await m.wait_until(lambda mm: mm.member_ids() == [], timeout=3)
    finally:
        await m.close()


def test_membership_needs_a_source() -> None:
    with pytest.raises(ValueError):
        Membership(gateway_id="gw")


def test_load_tracker_counts_own_requests_once() -> None:
    t = LoadTracker(settle=0.2, initial_mean_cost=100)
    t.add("w", "a", 100, now=0.0)
    t.add("w", "b", 100, now=0.0)
    assert t.load("w") == 200
    # stats right away: the worker has not counted a and b yet; it reports 3 requests of others
    t.on_stats("w", stats("w", running=3), now=0.05)
    assert t.load("w") == 200 + 3 * t.mean_cost
    # later stats include a and b: others = 5 - 2
    t.on_stats("w", stats("w", running=4, queue=1), now=0.5)
    assert t.load("w") == 200 + 3 * t.mean_cost
    t.release("w", "a")
    t.release("w", "b")
    t.release("w", "b")  # idempotent
    t.on_stats("w", stats("w", running=0), now=0.6)
    assert t.load("w") == 0
    with pytest.raises(ValueError):
        t.add("w", "c", 1, now=1.0)
        t.add("w", "c", 1, now=1.0)
    t.forget("w")  # c still in flight: kept until released
    assert t.inflight_count("w") == 1
    t.release("w", "c")
    assert t.loads() == {}


def test_first_output_marks_counted_before_settle() -> None:
    t = LoadTracker(settle=10.0, initial_mean_cost=50)
    t.add("w", "a", 100, now=0.0)
    t.first_output("w", "a", now=0.01, cached_tokens=0)
    t.on_stats("w", stats("w", running=1), now=0.02)
    assert t.load("w") == 100  # a is the one running request: not double counted


def test_reported_cache_hit_lowers_the_counted_cost() -> None:
    t = LoadTracker(initial_mean_cost=50)
    t.add("w", "miss", 700, now=0.0)
    t.add("w", "hit", 700, now=0.0)
    assert t.load("w") == 1400  # full cost until the worker says otherwise
    t.first_output("w", "miss", now=0.1, cached_tokens=0)
    t.first_output("w", "hit", now=0.1, cached_tokens=592)
    assert t.load("w") == 700 + 108
    t.first_output("w", "hit", now=0.2, cached_tokens=0)  # only the first output counts
    assert t.load("w") == 808
    t.release("w", "miss")
    t.release("w", "hit")
    assert t.load("w") == 0


def test_expected_hit_counts_only_new_tokens_until_the_worker_reports() -> None:
    t = LoadTracker(initial_mean_cost=50)
    h = PrefixHolders()
    key, other = b"k" * 16, b"o" * 16
    h.remember("w", key, 592)  # a request with this prefix got its first output on w
    t.add("w", "hit", 700, now=0.0, expected_cached=h.expected_cached("w", key))
    t.add("v", "cold", 700, now=0.0, expected_cached=h.expected_cached("v", key))
    t.add("w", "new", 700, now=0.0, expected_cached=h.expected_cached("w", other))
    assert (t.load("w"), t.load("v")) == (108 + 700, 700)
    assert t.committed("w") == 1400  # admission does not count a guessed hit
    t.first_output("w", "hit", now=0.1, cached_tokens=0)  # the guess was wrong (evicted): full cost
    assert t.load("w") == 1400 == t.committed("w")
    t.first_output("w", "new", now=0.1, cached_tokens=600)  # a reported hit counts for both
    assert t.load("w") == 800 == t.committed("w")
    t.release("w", "hit")
    t.release("w", "new")
    assert t.load("w") == 0 == t.committed("w")
    t.add("w", "x", 700, now=0.2, expected_cached=592)
    t.release("w", "x")  # released before any output
    assert t.load("w") == 0 == t.committed("w")
    t.forget("w")  # a departed worker holds nothing (the Router forgets its load and its prefixes)
    h.forget("w")
    assert h.expected_cached("w", key) == 0


async def test_malformed_endpoint_is_skipped_not_fatal(redis_url: str, r: redis.Redis) -> None:
    register(r, "good", "tcp://127.0.0.1:5")
    register(r, "bad", "not-an-endpoint")
    m = Membership(gateway_id="gw", redis_url=redis_url, poll_interval=60)
    router = Router(m, secret=b"s")
    await m.start()
    try:
        assert m.member_ids() == ["good"]
        assert set(router.policy.members) == {"good"}
    finally:
        await m.close()


def scan_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))


async def test_registry_is_read_from_the_sorted_set(redis_url: str, r: redis.Redis) -> None:
    """No SCAN over the keyspace: live ids come from the registry set, expired entries are swept."""
    register(r, "w1", "tcp://127.0.0.1:1")
    r.set(registration_key("ghost"), b'{"worker_id": "ghost"}')  # a record without a set entry
    r.zadd(REGISTRY_SET_KEY, {"expired": 1})  # an entry whose score (expiry) is long past
    before = scan_calls(r)
    m = Membership(gateway_id="gw", redis_url=redis_url, poll_interval=60)
    await m.start()
    try:
        await m.refresh()
        assert m.member_ids() == ["w1"]
        assert scan_calls(r) == before
        assert r.zscore(REGISTRY_SET_KEY, "expired") is None
        score = r.zscore(REGISTRY_SET_KEY, "w1")
        secs, micros = r.time()
        assert 4000 < score - (secs * 1000 + micros // 1000) <= 5000  # expiry on the Redis clock
    finally:
        await m.close()


async def wait_for(predicate, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_live_link_outlives_its_registration(redis_url: str, r: redis.Redis) -> None:
    """Redis emptied (restarted, flushed, expired): a worker whose link answers stays; a silent one goes."""
    worker = ThreadWorker()
    register(r, "w1", worker.endpoint)
    m = Membership(gateway_id="gw", redis_url=redis_url, poll_interval=60, dead_after=0.5)
    await m.start()
    try:
        await wait_for(lambda: m.live() == ["w1"], 5)
        r.flushall()
        await m.refresh()
        await asyncio.sleep(0.7)
        await m.refresh()
        assert m.member_ids() == ["w1"] and m.live() == ["w1"]
        worker.stop.set()
        await wait_for(lambda: m.status("w1") == FALLBACK_DEAD, 3)
        await m.refresh()
        assert m.member_ids() == []
    finally:
        worker.stop.set()
        await m.close()
        worker.thread.join(5)


async def test_event_loop_stall_keeps_workers_and_routing_memory() -> None:
    worker = ThreadWorker()
    m = Membership(gateway_id="gw", static_endpoints=[worker.endpoint], poll_interval=60, dead_after=0.5)
    router = Router(m, secret=b"s")
    came_back: list[str] = []
    m.on_stats(lambda e: came_back.append(e.member_id) if e.came_back else None)
    await m.start()
    try:
        await wait_for(lambda: m.live() == [worker.endpoint], 5)
        came_back.clear()
        router.holders.remember(worker.endpoint, b"k" * 16, 64)
        time.sleep(1.2)  # the gateway's loop stalls; the worker keeps sending stats
        assert m.status(worker.endpoint) is None
        await asyncio.sleep(0.3)
        assert came_back == [] and m.live() == [worker.endpoint]
        assert router.holders.expected_cached(worker.endpoint, b"k" * 16) == 64
        worker.stop.set()  # a real outage: dead, then back on the same endpoint with routing memory reset
        await wait_for(lambda: m.status(worker.endpoint) == FALLBACK_DEAD, 3)
        worker.thread.join(5)
        worker = ThreadWorker(worker.endpoint)
        await wait_for(lambda: came_back == [worker.endpoint], 5)
        assert router.holders.expected_cached(worker.endpoint, b"k" * 16) == 0
    finally:
        worker.stop.set()
        await m.close()
        worker.thread.join(5)
