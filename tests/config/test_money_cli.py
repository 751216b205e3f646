"""`switchyard money` on a real redis-server: prices, budgets, migration and spend as operators see them."""

from __future__ import annotations

import asyncio
import json

import pytest

from admission.money import MoneyLedger, MoneyPath, PriceBook
from admission.money.hierarchy import read_balance
from config.cli import main
from tenancy import tenant_admin as store
from tenancy.redis_client import async_client, sync_client

pytestmark = pytest.mark.timeout(60)


def cli(capsys, redis_url: str, *argv: str) -> object:
    assert main(["money", *argv, "--redis-url", redis_url, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_money_cli_round_trip(capsys, redis_url):
    r = sync_client(redis_url)
    store.create_tenant(r, "legacy")
    assert main(["redis", "migrate-keys", "--redis-url", redis_url]) == 0
    assert "tenant legacy -> a project of organization default" in capsys.readouterr().out
    store.create_tenant(r, "search")
    assert cli(capsys, redis_url, "migrate") == {"moved": ["search"]}
    assert cli(capsys, redis_url, "migrate") == {"moved": []}
    assert cli(capsys, redis_url, "assign", "search", "acme") == {"project": "search", "org": "acme"}
    assert cli(capsys, redis_url, "prices", "tiny", "--input", "0.15", "--output", "0.6") == {
        "tiny": {"input": "0.150000", "cached": "0.150000", "output": "0.600000", "batch": "1.000000"}}
    got = cli(capsys, redis_url, "prices", "tiny", "--input", "0.15", "--output", "0.6", "--batch", "0.5")
    assert got["tiny"]["batch"] == "0.500000"
    assert main(["money", "prices", "tiny", "--input", "1", "--output", "1", "--batch", "1.5",
                 "--redis-url", redis_url]) == 1
    assert "between 0 and 1" in capsys.readouterr().err
    got = cli(capsys, redis_url, "budget", "organization", "acme", "--usd", "12.5", "--period", "day")
    assert got["budget_usd"] == "12.500000" and got["org"] == "acme"
    cli(capsys, redis_url, "budget", "user", "search", "--usd", "1", "--org", "acme")
    assert main(["money", "budget", "key", "x", "--usd", "-1", "--redis-url", redis_url]) == 1
    assert "non-negative" in capsys.readouterr().err

    async def spend() -> None:
        client = async_client(redis_url)
        ledger = MoneyLedger(client, PriceBook(client))
        hold = await ledger.reserve(MoneyPath("acme", "search", "k" * 64, "tiny", "u1"), 1000, 100)
        await ledger.settle(hold, 1000, 0, 100)              # 150 + 60 micro-dollars
        await client.aclose()

    asyncio.run(spend())
    assert read_balance(r, "acme", "organization", "acme")["spent_micro"] == 210
    days = cli(capsys, redis_url, "spend", "--org", "acme", "--days", "1", "--by", "user")
    (rows,) = days.values()
    assert rows == {"user:search/u1": {"cost_usd": "0.000210", "requests": 1, "input_tokens": 1000,
                                       "cached_tokens": 0, "output_tokens": 100}}
    r.close()


def test_money_cli_sets_level_and_model_limits(capsys, redis_url):
    got = cli(capsys, redis_url, "limits", "key", "k" * 64, "--rpm", "30", "--max-concurrent", "4",
              "--org", "acme")
    assert got == {"org": "acme", "level": "key", "ident": "k" * 64, "model": None, "tpm": 0, "rpm": 30,
                   "max_concurrent": 4}
    got = cli(capsys, redis_url, "limits", "project", "search", "--tpm", "9000", "--model", "tiny",
              "--org", "acme")
    assert (got["model"], got["tpm"]) == ("tiny", 9000)
    assert cli(capsys, redis_url, "limits", "user", "search", "--rpm", "5", "--org", "acme")["rpm"] == 5
    got = cli(capsys, redis_url, "budget", "organization", "acme", "--usd", "2", "--model", "tiny")
    assert (got["model"], got["budget_usd"]) == ("tiny", "2.000000")
    assert main(["money", "limits", "project", "search", "--tpm", "5", "--redis-url", redis_url]) == 1
    assert "tenant record" in capsys.readouterr().err
