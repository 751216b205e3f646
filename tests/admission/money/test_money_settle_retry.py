"""A money settle that meets an unreachable Redis is tried again: charged once, its hold freed, never lost."""

from __future__ import annotations

import pytest
import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError

from admission.money import ledger as ledger_mod
from admission.money import money_gate
from admission.money.hierarchy import assign_project, read_balance, set_budget
from admission.money.money_gate import MoneyGate
from admission.money.prices import set_price
from tenancy.redis_client import BoundedRedisCluster, async_client
from tenancy.tenancy_errors import QuotaServiceUnavailable

pytestmark = pytest.mark.timeout(60)


class FailingFirst:
    """MONEY_SETTLE whose first `fails` calls raise as an unreachable Redis does (the last after running)."""

    def __init__(self, script, fails: int) -> None:
        self.script, self.fails, self.calls = script, fails, 0

    async def __call__(self, client, keys, args):
        self.calls += 1
        if self.calls < self.fails:
            raise QuotaServiceUnavailable("quota store unreachable: TimeoutError")
        if self.calls == self.fails:
            await self.script(client, keys, args)  # ran, but its answer never came back
            raise QuotaServiceUnavailable("quota store unreachable: TimeoutError")
        return await self.script(client, keys, args)


@pytest.mark.parametrize("fails", [1, 3])
async def test_settle_is_retried_and_charged_exactly_once(r, redis_url, monkeypatch, fails):
    set_price(r, "*", "0", None, "1000")
    assign_project(r, "shop", "acme")
    set_budget(r, "acme", "organization", "acme", "1", "day")
    monkeypatch.setattr(money_gate, "SETTLE_RETRY_S", (0.0, 0.0, 0.0), raising=False)
    client = async_client(redis_url)
    try:
        gate = MoneyGate(client, 900.0)
        hold = await gate.hold("shop", "k" * 64, "tiny", "u1", 0, 10)
        assert read_balance(r, "acme", "organization", "acme")["held_micro"] == 10_000
        flaky = FailingFirst(ledger_mod.MONEY_SETTLE, fails)
        monkeypatch.setattr(ledger_mod, "MONEY_SETTLE", flaky)
        await gate.settle(hold, True, 0, 0, 4)
        assert flaky.calls == fails + 1
        assert read_balance(r, "acme", "organization", "acme") == {"spent_micro": 4000, "held_micro": 0}
    finally:
        await client.aclose()


@pytest.mark.parametrize("error", [
    AttributeError("'NoneType' object has no attribute 'writelines'"),
    RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False>; the handler is "
                 "closed")])
async def test_closed_cluster_connection_is_a_connection_error(monkeypatch, error):
    async def closed_under(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(aredis.RedisCluster, "execute_command", closed_under)
    client = BoundedRedisCluster(host="127.0.0.1", port=7000)
    client._initialize = False
    with pytest.raises(RedisConnectionError):
        await client.execute_command("EVALSHA", "x", 0)
    with pytest.raises(QuotaServiceUnavailable):
        keys = ["{o:a}:holds", "{o:a}:hold:1", "{o:a}:spend:1"]
        await ledger_mod.MONEY_SETTLE(client, keys, [0, 1, 0, 0, 0])


async def test_other_runtime_errors_of_the_cluster_client_are_not_hidden(monkeypatch):
    async def bug(self, *args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(aredis.RedisCluster, "execute_command", bug)
    client = BoundedRedisCluster(host="127.0.0.1", port=7000)
    client._initialize = False
    with pytest.raises(RuntimeError, match="a bug"):
        await client.execute_command("GET", "x")
