"""Dollar budgets on a real Redis: exact under concurrency, refunds, levels named, live prices, migration."""

from __future__ import annotations

import asyncio
import calendar
import hashlib
import random
import time

import pytest
from redis.crc import key_slot

from admission.money import BudgetExceeded, MoneyLedger, MoneyPath, PriceBook
from admission.money.hierarchy import (
    assign_project,
    migrate_projects,
    project_org,
    read_balance,
    read_spend,
    set_budget,
)
from admission.money.keys import hold_key, holds_key, spend_key
from admission.money.prices import Price, set_price
from tenancy import tenant_admin as store
from tenancy.redis_client import async_client

pytestmark = pytest.mark.timeout(60)
PATH = MoneyPath("acme", "search", "d" * 64, "tiny", None)


@pytest.fixture()
async def ledgers(redis_url):
    """Three ledgers on their own connections: three gateways over one Redis."""
    clients = [async_client(redis_url) for _ in range(3)]
    yield [MoneyLedger(c, PriceBook(c)) for c in clients]
    for c in clients:
        await c.aclose()


def test_price_cost_is_exact_integer_arithmetic():
    p = Price(input=150_000, cached=75_000, output=600_000)  # $0.15 / $0.075 / $0.60 per million
    assert p.cost(1000, 400, 100) == 600 * 150_000 // 10**6 + 400 * 75_000 // 10**6 + 60
    assert p.cost(1, 0, 0) == 1                       # rounded up once, never down to free
    assert p.max_cost(1000, 100) == p.cost(1000, 0, 100)
    assert Price(10, 20, 0).max_cost(10**6, 0) == 20  # cached dearer than input: the hold still covers it


async def test_batch_lines_pay_the_batch_fraction_exactly(r, ledgers):
    p = Price(input=150_000, cached=75_000, output=600_000, batch_ppm=500_000)
    total = 600 * 150_000 + 400 * 75_000 + 101 * 600_000
    assert p.cost(1000, 400, 101, batch=True) == -(-total // 2_000_000)
    assert p.cost(1, 0, 0, batch=True) == 1 and p.max_cost(10, 10, batch=True) == 4  # 3.75 µ$: up once
    set_price(r, "tiny", "1", None, "10", batch="0.5")
    hold = await ledgers[0].reserve(PATH, 100, 90, batch=True)  # (100 + 900) / 2
    assert hold.reserved_micro == 500 and hold.batch
    await ledgers[0].settle(hold, 100, 0, 10)
    assert hold.cost_micro == 100                            # (100 + 100) / 2
    set_price(r, "tiny", "1", None, "10")                    # the fraction stays until it is set again
    await asyncio.sleep(1.05)
    assert (await ledgers[1].prices.get("tiny")).batch_ppm == 500_000
    full = await ledgers[1].reserve(PATH, 100, 90)           # an interactive request pays in full
    assert full.reserved_micro == 1000 and not full.batch
    await ledgers[1].refund(full)
    with pytest.raises(ValueError, match="between 0 and 1"):
        set_price(r, "tiny", "1", None, "10", batch="2")


async def test_concurrent_reserves_never_overspend(r, ledgers):
    set_price(r, "tiny", "1", "0.5", "10")            # max cost of 100 + 90 tokens: 100 + 900 = 1000 µ$
    set_budget(r, "acme", "organization", "acme", "0.05")  # 50 holds of the maximum fit
    rng = random.Random(7)
    costs: list[int] = []

    async def one(i: int) -> bool:
        ledger = ledgers[i % 3]
        try:
            hold = await ledger.reserve(PATH, 100, 90)
        except BudgetExceeded as exc:
            assert exc.level == "organization" and exc.budget_micro == 50_000
            return False
        await asyncio.sleep(rng.random() * 0.01)
        out, cached = rng.randint(0, 90), rng.randint(0, 100)
        assert await ledger.settle(hold, 100, cached, out)
        costs.append(hold.cost_micro)
        return True

    admitted = sum(await asyncio.gather(*(one(i) for i in range(200))))
    bal = read_balance(r, "acme", "organization", "acme")
    assert bal == {"spent_micro": sum(costs), "held_micro": 0}
    assert sum(costs) <= 50_000 and admitted >= 50       # no overspend, no early refusal
    day = read_spend(r, "acme", 1)[time.strftime("%Y%m%d", time.gmtime())]
    assert day["org|cost_micro"] == sum(costs) and day["org|requests"] == admitted
    assert day["project:search|cost_micro"] == sum(costs) and day["model:tiny|cost_micro"] == sum(costs)


async def test_refund_and_settle_once(r, ledgers):
    set_price(r, "tiny", "2", None, "4")
    set_budget(r, "acme", "project", "search", "1", "day")
    hold = await ledgers[0].reserve(PATH, 10, 20)
    assert read_balance(r, "acme", "project", "search")["held_micro"] == hold.reserved_micro == 100
    assert await ledgers[0].refund(hold) is True
    assert read_balance(r, "acme", "project", "search") == {"spent_micro": 0, "held_micro": 0}
    hold2 = await ledgers[1].reserve(PATH, 10, 20)
    assert await ledgers[1].settle(hold2, 10, 5, 3) is True  # cached at the input price: 20 + 12 µ$
    hold2.settled = False                                   # a second gateway's retry of the same settle
    assert await ledgers[2].settle(hold2, 10, 5, 3) is False
    assert read_balance(r, "acme", "project", "search") == {"spent_micro": 32, "held_micro": 0}
    assert r.hgetall(spend_key("acme", time.strftime("%Y%m%d", time.gmtime())))[b"org|cost_micro"] == b"32"


async def test_refusal_names_the_narrowest_failing_level(r, ledgers):
    set_price(r, "*", "0", None, "1000")                    # 1000 $/M output: 1000 µ$ per token
    set_budget(r, "acme", "organization", "acme", "100", "month")
    set_budget(r, "acme", "key", "d" * 64, "0.005", "day")
    with pytest.raises(BudgetExceeded) as exc:
        await ledgers[0].reserve(PATH, 0, 6)
    assert exc.value.level == "key" and exc.value.never_fits
    assert "retry-after" not in exc.value.headers()
    hold = await ledgers[0].reserve(PATH, 0, 3)
    assert (hold.narrowest, hold.remaining_micro) == ("key", 2000)
    assert hold.headers()["x-budget-remaining-usd"] == "0.002000"
    with pytest.raises(BudgetExceeded) as exc:
        await ledgers[0].reserve(PATH, 0, 3)
    assert exc.value.level == "key" and not exc.value.never_fits and exc.value.used_micro == 3000
    now = time.time()
    assert exc.value.reset_at == (int(now) // 86400 + 1) * 86400
    assert 0 < int(exc.value.headers(now)["retry-after"]) <= 86401
    await ledgers[0].settle(hold, 0, 0, 3)
    set_budget(r, "acme", "project", "search", "100", user_default=True)
    set_budget(r, "acme", "project", "search", "100", "month")
    set_budget(r, "acme", "project", "search", "0.002", "month", user_default=True)
    set_budget(r, "acme", "key", "d" * 64, "0", "day")      # 0: unlimited again, applied at once
    user = MoneyPath("acme", "search", "d" * 64, "tiny", "end-user-1")
    with pytest.raises(BudgetExceeded) as exc:
        await ledgers[1].reserve(user, 0, 3)
    assert exc.value.level == "user" and "retry-after" not in exc.value.headers()
    y, m = time.gmtime()[:2]
    assert exc.value.reset_at == calendar.timegm((y + m // 12, m % 12 + 1, 1, 0, 0, 0))
    other = MoneyPath("acme", "search", "d" * 64, "tiny", "end-user-2")
    await ledgers[1].settle(await ledgers[1].reserve(other, 0, 2), 0, 0, 2)
    assert read_balance(r, "acme", "user", "end-user-2", "search")["spent_micro"] == 2000


async def test_live_price_edit_applies_within_one_second(r, ledgers):
    set_price(r, "tiny", "1", None, "1")
    assert (await ledgers[0].prices.get("tiny")).output == 1_000_000
    set_price(r, "tiny", "1", None, "3")
    await asyncio.sleep(1.0)
    assert (await ledgers[0].prices.get("tiny")).output == 3_000_000
    hold = await ledgers[0].reserve(PATH, 0, 1)
    set_price(r, "tiny", "1", None, "9")                     # the admitted request keeps its price
    await ledgers[0].settle(hold, 0, 0, 1)
    assert hold.cost_micro == 3


async def test_expired_hold_of_a_dead_gateway_is_given_back_once(r, redis_url):
    client = async_client(redis_url)
    try:
        ledger = MoneyLedger(client, PriceBook(client), hold_ttl_s=0.05)
        set_price(r, "tiny", "0", None, "1000")
        set_budget(r, "acme", "organization", "acme", "0.01")
        lost = await ledger.reserve(PATH, 0, 10)             # its gateway dies: never settled
        await asyncio.sleep(0.1)
        fresh = await ledger.reserve(PATH, 0, 10)            # sweeps the expired hold, then fits
        assert read_balance(r, "acme", "organization", "acme")["held_micro"] == 10_000
        assert await ledger.settle(lost, 0, 0, 4) is True    # a late settle charges, refunds nothing twice
        assert await ledger.settle(fresh, 0, 0, 1) is True
        assert read_balance(r, "acme", "organization", "acme") == {"spent_micro": 5000, "held_micro": 0}
    finally:
        await client.aclose()


def test_migration_is_idempotent_and_keeps_assignments(r):
    store.create_tenant(r, "alpha")
    store.create_tenant(r, "beta")
    assert migrate_projects(r) == ["alpha", "beta"]
    assert migrate_projects(r) == []
    assign_project(r, "beta", "bigco")
    store.create_tenant(r, "gamma")
    assert migrate_projects(r) == ["gamma"]
    assert [project_org(r, p) for p in ("alpha", "beta", "gamma")] == ["default", "bigco", "default"]


def test_one_admission_keys_share_one_slot():
    user = MoneyPath("acme", "search", "d" * 64, "tiny", "u" * 300)
    keys = [holds_key("acme"), hold_key("acme", "x"), spend_key("acme", "20261129")]
    keys += [k for level in user.levels() for k in (level.config, level.balance)]
    assert len({key_slot(k.encode()) for k in keys}) == 1
    assert all(len(k) < 200 for k in keys)                   # a long `user` id goes by its digest
    spaced = MoneyPath("acme", "search", "d" * 64, "tiny", "John Doe").levels()[-1].balance
    assert " " not in spaced and spaced.endswith("search/sha256:" + hashlib.sha256(b"John Doe").hexdigest())
