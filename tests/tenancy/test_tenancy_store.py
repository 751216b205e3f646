"""Tenants and API keys in a real Redis: digests at rest, revoke, disable and live edits seen within 1 s."""

from __future__ import annotations

import asyncio
import time

import pytest

from tenancy import apikeys
from tenancy import tenant_admin as store
from tenancy.directory import TenantDirectory
from tenancy.redis_client import async_client
from tenancy.schema import BATCH, INTERACTIVE, config_key
from tenancy.tenancy_errors import AmbiguousKeyPrefix, KeyNotFound, TenancyError, TenantExists, TenantNotFound

pytestmark = pytest.mark.timeout(30)


def test_create_get_update_list(r):
    t = store.create_tenant(r, "acme", tpm=5000, rpm=60, priority=BATCH, allowed_models="m1, m2")
    assert (t.tpm, t.rpm, t.priority, t.allowed_models) == (5000, 60, BATCH, ("m1", "m2"))
    assert t.max_concurrent == 16 and t.active and len(t.salt) == 32
    assert t.allows_model("m1") and not t.allows_model("m3")
    assert t.effective_priority(INTERACTIVE) == BATCH
    with pytest.raises(TenantExists):
        store.create_tenant(r, "acme")
    t2 = store.update_tenant(r, "acme", tpm=7000, allowed_models="*")
    assert t2.tpm == 7000 and t2.allowed_models is None and t2.salt == t.salt
    store.create_tenant(r, "beta")
    store.issue_key(r, "beta")
    listed = store.list_tenants(r)
    assert [(tn.name, n) for tn, n in listed] == [("acme", 0), ("beta", 1)]
    with pytest.raises(TenantNotFound):
        store.update_tenant(r, "nope", tpm=1)


def test_bad_input_is_refused(r):
    for bad in ("", "a b", "{x}", "-lead", "x" * 65):
        with pytest.raises(ValueError):
            store.create_tenant(r, bad)
    with pytest.raises(TenancyError, match="non-negative"):
        store.create_tenant(r, "acme", tpm=-1)
    with pytest.raises(TenancyError, match="priority"):
        store.create_tenant(r, "acme", priority="urgent")
    for field in ("max_tokens", "default_max_tokens"):  # 0 would fail every request at the worker
        with pytest.raises(TenancyError, match=f"{field} must be at least 1"):
            store.create_tenant(r, "acme", **{field: 0})
    assert not r.exists(config_key("acme"))


def test_only_digests_at_rest(r):
    store.create_tenant(r, "acme")
    keys = [store.issue_key(r, "acme") for _ in range(3)]
    assert all(k.startswith("sy-") and len(k) == 43 for k in keys)
    dump = []
    for name in r.scan_iter(count=1000):
        dump.append(name)
        kind = r.type(name)
        if kind == b"hash":
            dump += [x for kv in r.hgetall(name).items() for x in kv]
        elif kind == b"set":
            dump += list(r.smembers(name))
    blob = b"\n".join(dump)
    for k in keys:
        assert k.encode() not in blob
        assert k[3:].encode() not in blob  # not even the random part
        assert k[:10].encode() in blob     # the display prefix is stored in clear


def test_revoke_by_prefix_and_ambiguity(r):
    store.create_tenant(r, "acme")
    k1, k2 = store.issue_key(r, "acme"), store.issue_key(r, "acme")
    with pytest.raises(AmbiguousKeyPrefix):
        store.revoke_key(r, "sy-")
    info = store.revoke_key(r, k1[:10])
    assert info.tenant == "acme" and info.prefix == k1[:10]
    assert [k.prefix for k in store.list_keys(r, "acme")] == [k2[:10]]
    with pytest.raises(KeyNotFound):
        store.revoke_key(r, k1[:10])
    store.revoke_key(r, k2)  # the whole key works too
    assert store.list_keys(r) == []


async def _until(predicate, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if await predicate():
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def test_directory_sees_disable_revoke_and_edits_within_1s(r, redis_url):
    store.create_tenant(r, "acme", tpm=1000)
    key = store.issue_key(r, "acme")
    other = store.issue_key(r, "acme")
    client = async_client(redis_url)
    directory = TenantDirectory(client)
    try:
        t = await directory.authenticate(key)
        assert t is not None and t.name == "acme" and t.tpm == 1000
        assert await directory.authenticate("sy-" + "x" * 40) is None
        assert await directory.authenticate(None) is None and await directory.authenticate("Bearer") is None

        r.hset(config_key("acme"), "tpm", "2500")  # an operator's redis-cli HSET
        assert await _until(lambda: _tpm_is(directory, key, 2500), 1.0) < 1.0

        r.hset(config_key("acme"), "status", "disabled")
        assert await _until(lambda: _is_none(directory, key), 1.0) < 1.0
        r.hset(config_key("acme"), "status", "active")
        assert await _until(lambda: _is_some(directory, key), 1.0) < 1.0

        store.revoke_key(r, key[:10])
        assert await _until(lambda: _is_none(directory, key), 1.0) < 1.0
        assert await directory.authenticate(other) is not None
    finally:
        await client.aclose()


async def _tpm_is(d: TenantDirectory, key: str, tpm: int) -> bool:
    t = await d.authenticate(key)
    return t is not None and t.tpm == tpm


async def _is_none(d: TenantDirectory, key: str) -> bool:
    return await d.authenticate(key) is None


async def _is_some(d: TenantDirectory, key: str) -> bool:
    return await d.authenticate(key) is not None


async def test_directory_caches_and_shares_lookups(r, redis_url):
    store.create_tenant(r, "acme")
    key = store.issue_key(r, "acme")
    client = async_client(redis_url)
    directory = TenantDirectory(client)
    before = r.info("commandstats")
    try:
        results = await asyncio.gather(*(directory.authenticate(key) for _ in range(50)))
        assert all(t is not None and t.name == "acme" for t in results)
    finally:
        await client.aclose()
    after = r.info("commandstats")
    calls = sum(after[c]["calls"] - before.get(c, {"calls": 0})["calls"]
                for c in ("cmdstat_hmget", "cmdstat_hgetall"))
    assert calls == 2  # one key lookup + one config read for 50 concurrent authentications


def test_malformed_hand_edits_fall_back_safely(r):
    store.create_tenant(r, "acme")
    r.hset(config_key("acme"), mapping={"tpm": "lots", "status": "paused", "priority": "vip"})
    t = store.get_tenant(r, "acme")
    assert t.tpm == 100_000 and not t.active and t.priority == BATCH


class _SlowRedis:
    """A real client whose key look-ups take `delay_s`, counting how many run at once."""

    def __init__(self, client, delay_s: float) -> None:
        self.client, self.delay_s, self.running, self.peak, self.calls = client, delay_s, 0, 0, 0

    async def hmget(self, *args):
        self.running += 1
        self.calls += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay_s)
            return await self.client.hmget(*args)
        finally:
            self.running -= 1

    async def hgetall(self, *args):
        return await self.client.hgetall(*args)

    def pipeline(self, transaction: bool = True):
        self.pipelines = getattr(self, "pipelines", 0) + 1
        return _SlowPipeline(self, self.client.pipeline(transaction=transaction))


class _SlowPipeline:
    """The batched look-ups of unknown keys (`tenancy.key_batch`): each queued key counts as one running
    look-up."""

    def __init__(self, slow: _SlowRedis, pipe) -> None:
        self.slow, self.pipe, self.n = slow, pipe, 0

    def hmget(self, *args):
        self.n += 1
        self.pipe.hmget(*args)

    async def execute(self):
        self.slow.running += self.n
        self.slow.calls += self.n
        self.slow.peak = max(self.slow.peak, self.slow.running)
        try:
            await asyncio.sleep(self.slow.delay_s)
            return await self.pipe.execute()
        finally:
            self.slow.running -= self.n


def _unknown_key(i: int) -> str:
    return "sy-" + f"{i:040d}"


async def test_unknown_key_flood_cannot_evict_known_keys(r, redis_url):
    store.create_tenant(r, "acme")
    keys = [store.issue_key(r, "acme") for _ in range(3)]
    now = [100.0]
    client = async_client(redis_url)
    directory = TenantDirectory(client, max_entries=10, clock=lambda: now[0])
    try:
        for key in keys:
            assert await directory.authenticate(key) is not None
        for i in range(200):  # far more distinct unknown keys than the cache holds
            assert await directory.authenticate(_unknown_key(i)) is None
        for key in keys:  # still cached (the clock stood still): no Redis needed
            store.revoke_key(r, key[:10])
        assert all([await directory.authenticate(k) is not None for k in keys])
        # an unknown key is remembered briefly too, apart from the known ones
        before = r.info("commandstats").get("cmdstat_hmget", {"calls": 0})["calls"]
        assert await directory.authenticate(_unknown_key(199)) is None
        assert r.info("commandstats")["cmdstat_hmget"]["calls"] == before
    finally:
        await client.aclose()


async def test_known_keys_are_evicted_least_recently_used_first(r, redis_url):
    store.create_tenant(r, "acme")
    keys = [store.issue_key(r, "acme") for _ in range(4)]
    now = [100.0]
    client = async_client(redis_url)
    directory = TenantDirectory(client, max_entries=3, clock=lambda: now[0])
    try:
        for key in keys[:3]:
            await directory.authenticate(key)
        await directory.authenticate(keys[0])  # the oldest entry is the most recently used now
        await directory.authenticate(keys[3])  # evicts keys[1], the least recently used
        store.revoke_key(r, keys[0][:10])
        store.revoke_key(r, keys[1][:10])
        assert await directory.authenticate(keys[0]) is not None  # served from the cache
        assert await directory.authenticate(keys[1]) is None  # evicted, read again: revoked
    finally:
        await client.aclose()


async def test_unknown_key_lookups_are_capped_and_known_keys_never_wait(r, redis_url):
    from tenancy.tenancy_errors import QuotaServiceUnavailable

    store.create_tenant(r, "acme")
    key = store.issue_key(r, "acme")
    now = [100.0]
    client = async_client(redis_url)
    slow = _SlowRedis(client, delay_s=0.3)
    directory = TenantDirectory(slow, clock=lambda: now[0], max_unknown_lookups=4, unknown_wait_s=0.05)
    try:
        assert await directory.authenticate(key) is not None
        now[0] += 10.0  # the known key's entry is expired: its refresh needs Redis
        start = time.monotonic()
        flood = [asyncio.ensure_future(directory.authenticate(_unknown_key(i))) for i in range(40)]
        await asyncio.sleep(0.01)
        assert slow.running == 4  # the cap holds the unknown keys' look-ups
        assert await directory.authenticate(key) is not None  # not queued behind them
        assert time.monotonic() - start < 0.5
        results = await asyncio.gather(*flood, return_exceptions=True)
        assert slow.peak <= 5  # four unknown look-ups and the known key's refresh
        busy = [x for x in results if isinstance(x, QuotaServiceUnavailable)]
        assert len(busy) == 36 and results.count(None) == 4
        assert time.monotonic() - start < 1.0  # refused quickly, not after the pool's timeout
    finally:
        await client.aclose()


async def test_concurrent_unknown_keys_share_one_round_trip(r, redis_url):
    """A flood's pipelined requests arrive together: their look-ups go to Redis as one pipeline, not one call
    each, and each still gets its own answer."""
    store.create_tenant(r, "acme")
    key = store.issue_key(r, "acme")
    client = async_client(redis_url)
    slow = _SlowRedis(client, delay_s=0.01)
    directory = TenantDirectory(slow, max_unknown_lookups=8)
    try:
        owners = await asyncio.gather(*(directory.key_owner(apikeys.digest(k))
                                        for k in [_unknown_key(i) for i in range(7)] + [key]))
        assert owners == [None] * 7 + ["acme"] and slow.calls == 8 and slow.pipelines == 1
    finally:
        await client.aclose()


async def test_keys_of_the_wrong_shape_never_reach_redis(r, redis_url):
    client = async_client(redis_url)
    directory = TenantDirectory(client)
    try:
        before = r.info("commandstats").get("cmdstat_hmget", {"calls": 0})["calls"]
        for bad in ("sy-wrong", "sy-" + "x" * 39, "sy-" + "x" * 41, "sy-" + "x" * 39 + "!", "xy-" + "x" * 40,
                    "sy-" + "é" * 40):
            assert await directory.authenticate(bad) is None
        assert r.info("commandstats").get("cmdstat_hmget", {"calls": 0})["calls"] == before
        assert len(directory._unknown) == 0  # nor take a cache entry
    finally:
        await client.aclose()


def test_a_zero_token_cap_written_past_the_cli_reads_as_the_default():
    from tenancy.schema import INT_DEFAULTS, parse_int_field

    assert parse_int_field("max_tokens", "0") == INT_DEFAULTS["max_tokens"]
    assert parse_int_field("default_max_tokens", b"0") == INT_DEFAULTS["default_max_tokens"]
    assert parse_int_field("tpm", "0") == 0  # elsewhere 0 keeps its meaning (no limit)
