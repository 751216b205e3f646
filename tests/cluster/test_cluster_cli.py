"""`switchyard tenants|keys|redis` as real subprocesses against the Redis Cluster, and quota edits made with
`redis-cli -c` (which follows MOVED) read back through the gateway's tenant directory within 1 s."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from common.worker_registry import (
    LEGACY_REGISTRY_KEY_PREFIX,
    LEGACY_REGISTRY_SET_KEY,
    REGISTRY_SET_KEY,
    registration_key,
)
from config.local_stack.redis_cluster import RedisClusterProcs
from tenancy import TenantDirectory
from tenancy import tenant_admin as store
from tenancy.redis_client import async_client, sync_client
from tenancy.schema import GATEWAYS_KEY, LEGACY_GATEWAYS_KEY, config_key
from tests.tenancy.test_cli_tenants import cli

pytestmark = [pytest.mark.redis_cluster, pytest.mark.timeout(90)]


def redis_cli_c(cluster: RedisClusterProcs, *args: str) -> str:
    """`redis-cli -c` against the first node: cluster mode, following redirections like an operator would."""
    out = subprocess.run(["redis-cli", "-c", "-p", str(cluster.nodes[0].port), *args], capture_output=True,
                         text=True, timeout=10, check=True)
    return out.stdout.strip()


def test_tenants_and_keys_commands_against_the_cluster(cluster_url) -> None:
    for i in range(4):  # tenants whose keys sit on different primaries
        out = cli("tenants", "create", f"t{i}", "--tpm", "5000", "--rpm", str(30 + i), url=cluster_url)
        assert out.returncode == 0, out.stderr
    assert cli("tenants", "set", "t1", "--max-concurrent", "7", url=cluster_url).returncode == 0
    key = cli("keys", "issue", "t2", url=cluster_url).stdout.strip()
    assert key.startswith("sy-")
    assert cli("tenants", "disable", "t3", url=cluster_url).returncode == 0
    listed = cli("tenants", "list", url=cluster_url).stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in listed[1:]}
    assert sorted(rows) == ["t0", "t1", "t2", "t3"]
    assert rows["t1"][3:6] == ["5000", "31", "7"] and rows["t3"][1] == "disabled" and rows["t2"][9] == "1"
    keys = cli("keys", "list", url=cluster_url).stdout  # SCAN over every primary
    assert key[:10] in keys and "t2" in keys
    assert cli("keys", "revoke", key[:10], url=cluster_url).returncode == 0
    r = sync_client(cluster_url)
    try:
        assert store.list_keys(r) == []
        assert store.get_tenant(r, "t0").rpm == 30
    finally:
        r.close()


async def test_quota_edited_with_redis_cli_applies_on_every_gateway_within_1s(cluster_url,
                                                                              redis_cluster) -> None:
    r = sync_client(cluster_url)
    store.create_tenant(r, "acme", tpm=1000)
    key = store.issue_key(r, "acme")
    r.close()
    clients = [async_client(cluster_url) for _ in range(3)]
    directories = [TenantDirectory(c) for c in clients]  # three gateways' caches
    try:
        for d in directories:
            assert (await d.authenticate(key)).tpm == 1000
        assert redis_cli_c(redis_cluster, "HSET", config_key("acme"), "tpm", "2500") == "0"
        took = await _until_all(directories, key, lambda t: t is not None and t.tpm == 2500)
        assert took < 1.0, took
        redis_cli_c(redis_cluster, "HSET", config_key("acme"), "status", "disabled")
        assert await _until_all(directories, key, lambda t: t is None) < 1.0
    finally:
        for c in clients:
            await c.aclose()


async def _until_all(directories: list[TenantDirectory], key: str, ok) -> float:
    start = time.monotonic()
    while time.monotonic() - start < 3.0:
        seen = [await d.authenticate(key) for d in directories]
        if all(ok(t) for t in seen):
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    return float("inf")


def test_migrate_keys_against_the_cluster(cluster_url) -> None:
    r = sync_client(cluster_url)
    try:
        seed_legacy_keys(r)
        out = cli("redis", "migrate-keys", "--dry-run", url=cluster_url)
        assert out.returncode == 0 and "3 key(s) would move" in out.stdout, out.stdout + out.stderr
        assert r.exists(LEGACY_GATEWAYS_KEY)  # a dry run changes nothing
        out = cli("redis", "migrate-keys", url=cluster_url)
        assert out.returncode == 0, out.stderr
        check_migrated(r)
        again = cli("redis", "migrate-keys", url=cluster_url)
        assert again.returncode == 0 and "nothing to migrate" in again.stdout
    finally:
        r.close()


def seed_legacy_keys(r) -> None:
    """Untagged keys as an older release wrote them, and one tagged set a newer worker already wrote."""
    now_ms = int(time.time() * 1000)
    r.zadd(LEGACY_GATEWAYS_KEY, {"gw-old": now_ms + 60_000})
    r.pexpire(LEGACY_GATEWAYS_KEY, 120_000)
    r.zadd(LEGACY_REGISTRY_SET_KEY, {"w1": now_ms + 60_000, "w2": now_ms + 1})
    r.zadd(REGISTRY_SET_KEY, {"w2": now_ms + 90_000, "w3": now_ms + 90_000})
    r.set(LEGACY_REGISTRY_KEY_PREFIX + "w1", b'{"worker_id": "w1"}', px=120_000)


def check_migrated(r) -> None:
    assert not r.exists(LEGACY_GATEWAYS_KEY, LEGACY_REGISTRY_SET_KEY, LEGACY_REGISTRY_KEY_PREFIX + "w1")
    assert r.zrange(GATEWAYS_KEY, 0, -1) == [b"gw-old"] and 0 < r.pttl(GATEWAYS_KEY) <= 120_000
    members = dict(r.zrange(REGISTRY_SET_KEY, 0, -1, withscores=True))
    assert set(members) == {b"w1", b"w2", b"w3"}  # merged
    assert members[b"w2"] > int(time.time() * 1000) + 60_000  # the later expiry won
    assert r.get(registration_key("w1")) == b'{"worker_id": "w1"}' and 0 < r.pttl(registration_key("w1"))
