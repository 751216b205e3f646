"""Membership against a real redis-server: registry watch, liveness by injected clock, draining, load."""

from __future__ import annotations

import json
import time

import pytest
import redis

from router import FALLBACK_DEAD, FALLBACK_DRAINING, Membership, Router
from router.holders import PrefixHolders
from router.load import LoadTracker
from worker.protocol import PROTOCOL_VERSION, WorkerStats, registration_key


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
    value = {"worker_id": wid, "endpoint": endpoint, "model": "m", "version": PROTOCOL_VERSION,
             "started_at": started_at}
    r.set(registration_key(wid), json.dumps(value), px=ttl_ms)


@pytest.fixture()
def r(redis_url: str):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


async def test_registry_members_liveness_and_draining(redis_url: str, r: redis.Redis) -> None:
    register(r, "w1", "tcp://127.0.0.1:1")
    register(r, "w2", "tcp://127.0.0.1:2")
    r.set("sy:worker:broken", b"not json")
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
