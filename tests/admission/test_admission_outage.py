"""Redis outages: fail closed fast, fail open within a per-gateway share, recover (NOSCRIPT) without
restart."""

from __future__ import annotations

import asyncio
import time

import pytest

from admission.budget import Budget
from admission.gateways import GatewayRegistry
from admission.hold import BudgetGuard
from admission.local_limits import LocalLimiter
from admission.results import QuotaExceeded
from tenancy import tenant_admin as store
from tenancy.directory import TenantDirectory
from tenancy.redis_client import async_client, sync_client
from tenancy.tenancy_errors import QuotaServiceUnavailable
from tests.conftest import RedisServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def private_redis():
    server = RedisServer()
    server.start()
    yield server
    server.stop()


async def test_fail_closed_then_recover_after_restart(private_redis):
    r = sync_client(private_redis.url)
    tenant = store.create_tenant(r, "acme", tpm=10_000, rpm=100)
    key = store.issue_key(r, "acme")
    r.close()
    client = async_client(private_redis.url)
    directory = TenantDirectory(client)
    guard = BudgetGuard(Budget(client))
    try:
        async with guard.hold(tenant, 10, 10) as res:
            res.record(5)
        private_redis.stop()
        await asyncio.sleep(0.6)  # let the directory cache go stale
        for call in (lambda: guard.acquire(tenant, 10, 10), lambda: directory.authenticate(key)):
            start = time.monotonic()
            with pytest.raises(QuotaServiceUnavailable):
                await call()
            assert time.monotonic() - start < 1.0
        # restart with an empty script cache: EVALSHA gets NOSCRIPT and reloads transparently
        private_redis.start()
        r = sync_client(private_redis.url)
        store.create_tenant(r, "acme", tpm=10_000, rpm=100)  # fresh (empty) Redis: re-create
        r.close()
        async with guard.hold(tenant, 10, 10) as res:
            assert res.result.admitted and not res.result.local
    finally:
        await guard.aclose()
        await client.aclose()


async def test_settle_during_outage_does_not_raise_or_hang(private_redis):
    r = sync_client(private_redis.url)
    tenant = store.create_tenant(r, "acme")
    r.close()
    client = async_client(private_redis.url)
    guard = BudgetGuard(Budget(client), settle_timeout_s=1.0)
    try:
        start = time.monotonic()
        async with guard.hold(tenant, 1, 1):
            private_redis.stop()
        assert time.monotonic() - start < 2.0  # settle gave up quickly; the lease expires by TTL
    finally:
        await guard.aclose()
        await client.aclose()


async def test_fail_open_admits_only_this_gateways_share(private_redis):
    r = sync_client(private_redis.url)
    tenant = store.create_tenant(r, "acme", tpm=6000, rpm=1000, max_concurrent=100)
    key = store.issue_key(r, "acme")
    r.close()
    client = async_client(private_redis.url)
    registry = GatewayRegistry(client, "gw-a", ttl_s=5)
    other = GatewayRegistry(client, "gw-b", ttl_s=5)
    directory = TenantDirectory(client, serve_stale_on_error=True)
    budget = Budget(client, fail_open=True, local=LocalLimiter(lambda: registry.live_count))
    try:
        await other.beat()
        assert await registry.beat() == 2
        assert await directory.authenticate(key) is not None
        private_redis.stop()
        await asyncio.sleep(0.6)
        seen = await directory.authenticate(key)  # stale-if-error keeps known tenants working
        assert seen is not None and seen.name == "acme"
        admitted = 0
        with pytest.raises(QuotaExceeded) as exc:
            for _ in range(100):
                res = await budget.reserve(tenant, 100, 400)
                assert res.result.local
                admitted += 500
        assert admitted == 3000  # half of tpm: two live gateways share the limit
        assert exc.value.result.local and exc.value.result.limit_tokens == 3000
        assert exc.value.result.limit_name == "tokens"
        await budget.settle(res)  # local settle refunds the unused 400
        await budget.reserve(tenant, 100, 300)
    finally:
        private_redis.start()
        await client.aclose()
