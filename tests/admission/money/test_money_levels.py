"""Rates, concurrency and per-model limits at every level of the money path, on a real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from admission.money import BudgetExceeded, LevelRateLimited, MoneyLedger, MoneyPath, PriceBook
from admission.money.hierarchy import read_balance, set_budget, set_limits
from admission.money.keys import balance_key
from tenancy.redis_client import async_client

pytestmark = pytest.mark.timeout(60)
KEY = "d" * 64
PATH = MoneyPath("acme", "search", KEY, "tiny", None)


@pytest.fixture()
async def ledgers(redis_url):
    """Two ledgers on their own connections: two gateways over one Redis."""
    clients = [async_client(redis_url) for _ in range(2)]
    yield [MoneyLedger(c, PriceBook(c)) for c in clients]
    for c in clients:
        await c.aclose()


async def test_key_rpm_refuses_the_third_request_and_writes_nothing(r, ledgers):
    assert set_limits(r, "acme", "key", KEY, rpm=2) == {"tpm": 0, "rpm": 2, "max_concurrent": 0}
    holds = [await ledgers[i].reserve(PATH, 10, 10) for i in range(2)]
    before = read_balance(r, "acme", "organization", "acme")
    with pytest.raises(LevelRateLimited) as exc:
        await ledgers[0].reserve(PATH, 10, 10)
    e = exc.value
    assert (e.level, e.kind, e.limit, e.status, e.code) == ("key", "rpm", 2, 429, "rate_limit_exceeded")
    assert 1 <= int(e.headers()["retry-after"]) <= 31 and e.headers()["x-ratelimit-level"] == "key"
    assert read_balance(r, "acme", "organization", "acme") == before  # nothing held for the refused one
    for h in holds:
        await ledgers[0].settle(h, 10, 0, 10)
    other_key = MoneyPath("acme", "search", "e" * 64, "tiny", None)
    await ledgers[1].refund(await ledgers[1].reserve(other_key, 10, 10))  # another key is not limited


async def test_concurrency_frees_at_settle_and_at_a_dead_gateways_expiry(r, redis_url, ledgers):
    set_limits(r, "acme", "organization", "acme", max_concurrent=2)
    first = await ledgers[0].reserve(PATH, 1, 1)
    second = await ledgers[1].reserve(PATH, 1, 1)
    with pytest.raises(LevelRateLimited) as exc:
        await ledgers[0].reserve(PATH, 1, 1)
    assert (exc.value.level, exc.value.kind, exc.value.used) == ("organization", "concurrency", 2)
    await ledgers[0].settle(first, 1, 0, 1)
    await ledgers[0].refund(await ledgers[0].reserve(PATH, 1, 1))  # the settled one's slot is free
    await ledgers[1].settle(second, 1, 0, 1)
    assert r.hget("{o:acme}:bal:organization:acme", "active") == b"0"
    client = async_client(redis_url)
    try:
        short = MoneyLedger(client, PriceBook(client), hold_ttl_s=0.05)
        set_limits(r, "acme", "organization", "acme", max_concurrent=1)
        lost = await short.reserve(PATH, 1, 1)               # its gateway dies: never settled
        with pytest.raises(LevelRateLimited):
            await short.reserve(PATH, 1, 1)
        await asyncio.sleep(0.1)
        fresh = await short.reserve(PATH, 1, 1)              # the lease ended: its slot came back
        assert await short.settle(lost, 1, 0, 1) is True     # a late settle frees no slot twice
        assert r.hget("{o:acme}:bal:organization:acme", "active") == b"1"
        await short.settle(fresh, 1, 0, 1)
        assert r.hget("{o:acme}:bal:organization:acme", "active") == b"0"
    finally:
        await client.aclose()


async def test_user_tpm_gives_back_unused_tokens_and_refuses_what_never_fits(r, ledgers):
    set_limits(r, "acme", "project", "search", tpm=250, user_default=True)
    user = MoneyPath("acme", "search", KEY, "tiny", "end-user-1")
    a = await ledgers[0].reserve(user, 50, 50)
    b = await ledgers[1].reserve(user, 50, 50)
    with pytest.raises(LevelRateLimited) as exc:
        await ledgers[0].reserve(user, 50, 50)
    assert (exc.value.level, exc.value.kind, exc.value.requested) == ("user", "tpm", 100)
    await ledgers[0].settle(a, 50, 0, 5)                    # 45 of its 100 tokens unused: back in the bucket
    await ledgers[0].settle(b, 50, 0, 5)
    await ledgers[1].refund(await ledgers[1].reserve(user, 50, 50))
    with pytest.raises(LevelRateLimited) as exc:
        await ledgers[0].reserve(user, 200, 100)
    assert exc.value.never_fits and exc.value.status == 400 and "retry-after" not in exc.value.headers()
    other = MoneyPath("acme", "search", KEY, "tiny", "end-user-2")  # each end user has its own bucket
    await ledgers[0].refund(await ledgers[0].reserve(other, 50, 50))


async def test_per_model_budget_and_tpm_touch_only_that_model(r, ledgers):
    from admission.money.prices import set_price

    set_price(r, "*", "0", None, "1000")                    # 1000 µ$ per output token
    set_budget(r, "acme", "project", "search", "0.003", "day", model="tiny")
    set_limits(r, "acme", "organization", "acme", tpm=40, model="big")
    hold = await ledgers[0].reserve(PATH, 0, 3)
    with pytest.raises(BudgetExceeded) as exc:
        await ledgers[0].reserve(PATH, 0, 1)
    assert exc.value.level == "project (model tiny)" and "project (model tiny) budget" in exc.value.message()
    await ledgers[0].settle(hold, 0, 0, 3)
    big = MoneyPath("acme", "search", KEY, "big", None)
    await ledgers[1].settle(await ledgers[1].reserve(big, 10, 20), 10, 0, 20)  # not tiny's budget
    with pytest.raises(LevelRateLimited) as exc:
        await ledgers[1].reserve(big, 10, 20)               # 30 of 40 tokens used this minute
    assert (exc.value.level, exc.value.kind) == ("organization (model big)", "tpm")


def test_limits_are_checked_where_they_are_set(r):
    with pytest.raises(ValueError, match="tenant record"):
        set_limits(r, "acme", "project", "search", tpm=10)
    with pytest.raises(ValueError, match="non-negative integer"):
        set_limits(r, "acme", "key", KEY, rpm=-1)
    with pytest.raises(ValueError, match="organization or a project"):
        set_limits(r, "acme", "key", KEY, tpm=1, model="tiny")
    assert set_limits(r, "acme", "project", "search", rpm=5, model="tiny")["rpm"] == 5
    assert set_limits(r, "acme", "project", "search", tpm=7, model="tiny") == {"tpm": 7, "rpm": 5,
                                                                                "max_concurrent": 0}


async def test_rolling_24h_budget_counts_the_last_24_hourly_buckets(r, ledgers):
    from admission.money.prices import set_price

    set_price(r, "*", "0", None, "1000")                    # 1000 µ$ per output token
    set_budget(r, "acme", "key", KEY, "0.005", "24h")
    await ledgers[0].settle(await ledgers[0].reserve(PATH, 0, 3), 0, 0, 3)
    bal, hour = balance_key("acme", "key", KEY), int(time.time()) // 3600
    r.hset(bal, f"r:{hour - 23}", 1000)                     # spent 23 hours ago: still in the window
    with pytest.raises(BudgetExceeded) as exc:
        await ledgers[1].reserve(PATH, 0, 2)                # 3000 + 1000 + 2000 > 5000
    assert exc.value.level == "key" and exc.value.rolling and "rolling window" in exc.value.message()
    assert exc.value.reset_at == (hour + 1) * 3600 and "retry-after" in exc.value.headers()
    assert read_balance(r, "acme", "key", KEY)["spent_micro"] == 4000
    r.hdel(bal, f"r:{hour - 23}")
    r.hset(bal, f"r:{hour - 25}", 1000)                     # 25 hours ago: out of it, and dropped
    await ledgers[1].refund(await ledgers[1].reserve(PATH, 0, 2))
    assert not r.hexists(bal, f"r:{hour - 25}")
    with pytest.raises(ValueError, match="24h or 30d"):
        set_budget(r, "acme", "key", KEY, "1", "week")


async def test_versions_of_a_model_share_its_family_limits(r, ledgers):
    set_limits(r, "acme", "project", "search", rpm=1, model="tiny")
    await ledgers[0].refund(await ledgers[0].reserve(MoneyPath("acme", "search", KEY, "tiny@v1"), 1, 1))
    with pytest.raises(LevelRateLimited) as exc:
        await ledgers[0].reserve(MoneyPath("acme", "search", KEY, "tiny@v2"), 1, 1)
    assert exc.value.level == "project (model tiny)"


async def test_every_balance_a_hold_touches_expires(r, ledgers):
    set_limits(r, "acme", "key", KEY, rpm=100)
    user = MoneyPath("acme", "search", KEY, "tiny", "end-user-9")
    for _ in range(2):  # the second hold of the day does not renew, the first did
        await ledgers[0].settle(await ledgers[0].reserve(user, 1, 1), 1, 0, 1)
    balances = [level.balance for level in user.levels() if not level.optional]
    assert all(0 < r.ttl(b) <= 40 * 86_400 for b in balances), [r.ttl(b) for b in balances]


async def test_live_hash_reads_ahead_in_the_background_and_is_never_older_than_its_interval(r, redis_url):
    from admission.money.live_hash import LiveHash

    client = async_client(redis_url)
    try:
        parse = lambda raw: {k.decode(): v.decode() for k, v in raw.items()}  # noqa: E731
        live = LiveHash(client, "live-test", parse, 0.4)
        r.hset("live-test", "a", "1")
        assert await live.value() == {"a": "1"}                  # the first read is inline
        r.hset("live-test", "a", "2")
        await asyncio.sleep(0.25)                                 # past half the interval
        assert await live.value() == {"a": "1"}                  # served at once; a read starts behind it
        await asyncio.sleep(0.05)
        assert await live.value() == {"a": "2"}                  # the read ahead landed
        r.hset("live-test", "a", "3")
        await asyncio.sleep(0.45)                                 # past the whole interval: read inline
        assert await live.value() == {"a": "3"}
    finally:
        await client.aclose()
