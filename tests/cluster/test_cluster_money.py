"""Dollar budgets on the 3-primary Redis Cluster: one slot per organization, exact under concurrency."""

from __future__ import annotations

import asyncio

import pytest

from admission.money import BudgetExceeded, MoneyLedger, MoneyPath, PriceBook
from admission.money.hierarchy import read_balance, set_budget
from admission.money.prices import set_price
from tenancy.redis_client import async_client, sync_client

pytestmark = pytest.mark.timeout(60)


async def test_two_gateways_never_overspend_an_organization_on_the_cluster(cluster_url):
    r = sync_client(cluster_url)
    set_price(r, "tiny", "0", None, "1000")                  # 1000 micro-dollars an output token
    orgs = ["north", "south", "east"]                        # three tags: spread over the primaries
    for org in orgs:
        set_budget(r, org, "organization", org, "0.02")      # 20 tokens each
    clients = [async_client(cluster_url) for _ in range(2)]
    ledgers = [MoneyLedger(c, PriceBook(c)) for c in clients]

    async def one(i: int) -> int:
        org = orgs[i % 3]
        ledger = ledgers[i % 2]
        try:
            hold = await ledger.reserve(MoneyPath(org, "p", "k" * 64, "tiny"), 0, 3)
        except BudgetExceeded:
            return 0
        await asyncio.sleep(0.005)
        await ledger.settle(hold, 0, 0, 2 + i % 2)
        return hold.cost_micro

    try:
        costs = await asyncio.gather(*(one(i) for i in range(90)))
        for j, org in enumerate(orgs):
            spent = sum(costs[j::3])
            assert read_balance(r, org, "organization", org) == {"spent_micro": spent, "held_micro": 0}
            assert 0 < spent <= 20_000
            path = MoneyPath(org, "p", "k" * 64, "tiny")
            rest = await ledgers[j % 2].reserve(path, 0, (20_000 - spent) // 1000)
            assert rest.reserved_micro == 20_000 - spent            # the whole rest is still there to hold
    finally:
        for c in clients:
            await c.aclose()
    r.close()
