"""API keys' own policy on a real redis-server: a model scope that narrows the tenant's allow-list, an expiry
that even a cached key never outlives, rotation with a grace period, and old records without these fields."""

from __future__ import annotations

import asyncio
import time

import pytest

from tenancy import TenancyError, api_key_key, key_digest
from tenancy import tenant_admin as store
from tenancy.directory import TenantDirectory
from tenancy.redis_client import async_client

pytestmark = pytest.mark.timeout(60)


async def _with_directory(redis_url: str, body, **kw):  # noqa: ANN001, ANN202
    client = async_client(redis_url)
    try:
        return await body(TenantDirectory(client, **kw))
    finally:
        await client.aclose()


async def test_a_key_scope_narrows_the_tenant_allow_list_and_never_widens_it(r, redis_url):
    store.create_tenant(r, "open")
    store.create_tenant(r, "closed", allowed_models="m1,m2")
    scoped = store.issue_key(r, "open", models="m1, alias-a")
    narrowed = store.issue_key(r, "closed", models=["m2", "m3"])
    everything = store.issue_key(r, "closed", models="*")

    async def body(d: TenantDirectory) -> None:
        t = await d.authenticate(scoped)
        assert t.allowed_models == ("m1", "alias-a") and not t.allows_model("m2")
        t = await d.authenticate(narrowed)
        assert t.allowed_models == ("m2",) and not t.allows_model("m3") and not t.allows_model("m1")
        assert (await d.authenticate(everything)).allowed_models == ("m1", "m2")
        assert (await d.tenant("open")).allowed_models is None  # the tenant's own record is untouched

    await _with_directory(redis_url, body)
    assert r.hget(api_key_key(key_digest(everything)), "models") is None  # '*' stores no scope
    with pytest.raises(TenancyError, match="models"):
        store.issue_key(r, "open", models=" , ")


async def test_old_records_without_the_new_fields_authenticate_as_before(r, redis_url):
    store.create_tenant(r, "acme", allowed_models="m1")
    key = "sy-" + "o" * 40
    r.hset(api_key_key(key_digest(key)), mapping={"tenant": "acme", "prefix": key[:10], "created_at": "1.0"})
    r.sadd("{t:acme}:keys", key_digest(key))

    async def body(d: TenantDirectory) -> None:
        t = await d.authenticate(key)
        assert t is not None and t.name == "acme" and t.allowed_models == ("m1",)
        assert await d.key_owner(key_digest(key)) == "acme"

    await _with_directory(redis_url, body)
    [info] = store.list_keys(r, "acme")
    assert info.models is None and info.expires_at is None and not info.expired(time.time())


async def test_a_cached_key_is_refused_from_its_expiry_on(r, redis_url):
    store.create_tenant(r, "acme")
    key = store.issue_key(r, "acme", expires_at=1_000_100.0)
    wall, mono = [1_000_099.0], [50.0]

    async def body(d: TenantDirectory) -> None:
        assert await d.authenticate(key) is not None
        r.delete(api_key_key(key_digest(key)))  # from here only the cache can answer
        wall[0] = 1_000_099.9
        assert await d.authenticate(key) is not None
        wall[0] = 1_000_100.0  # the monotonic clock stood still: the entry is fresh, but the key expired
        assert await d.authenticate(key) is None and await d.key_owner(key_digest(key)) is None

    await _with_directory(redis_url, body, clock=lambda: mono[0], wall=lambda: wall[0])


async def test_an_operator_edit_of_expires_at_applies_within_one_second(r, redis_url):
    store.create_tenant(r, "acme")
    key = store.issue_key(r, "acme")

    async def body(d: TenantDirectory) -> float:
        assert await d.authenticate(key) is not None  # cached now
        r.hset(api_key_key(key_digest(key)), "expires_at", f"{time.time() - 5:.3f}")
        edited = time.monotonic()
        while await d.authenticate(key) is not None:
            assert time.monotonic() - edited < 1.0, "expired key still accepted after 1 s"
            await asyncio.sleep(0.02)
        return time.monotonic() - edited

    assert await _with_directory(redis_url, body) < 1.0


async def test_a_malformed_expiry_refuses_the_key(r, redis_url):
    store.create_tenant(r, "acme")
    key = store.issue_key(r, "acme")
    r.hset(api_key_key(key_digest(key)), "expires_at", "tomorrow")

    async def body(d: TenantDirectory) -> None:
        assert await d.authenticate(key) is None

    await _with_directory(redis_url, body)
    with pytest.raises(TenancyError, match="expires_at"):
        store.issue_key(r, "acme", expires_at=-1)


async def test_rotation_keeps_both_keys_until_the_grace_ends(r, redis_url):
    store.create_tenant(r, "acme")
    old = store.issue_key(r, "acme", models="m1")
    r.hset(api_key_key(key_digest(old)), "name", "ci")
    new, info = store.rotate_key(r, "acme", old[:10], grace_s=1.5)
    assert info.digest == key_digest(old) and info.expires_at == pytest.approx(time.time() + 1.5, abs=0.5)
    fields = {k.decode(): v.decode() for k, v in r.hgetall(api_key_key(key_digest(new))).items()}
    assert fields["models"] == "m1" and fields["name"] == "ci" and fields["rotated_from"] == info.digest
    assert "expires_at" not in fields and fields["prefix"] == new[:10]

    async def body(d: TenantDirectory) -> None:
        assert await d.authenticate(old) is not None and await d.authenticate(new) is not None
        await asyncio.sleep(2.1)  # the grace and a cache TTL
        assert await d.authenticate(old) is None
        t = await d.authenticate(new)
        assert t is not None and t.allowed_models == ("m1",)

    await _with_directory(redis_url, body)


def test_rotation_never_extends_an_old_key_and_finds_it_by_digest(r):
    store.create_tenant(r, "acme")
    store.create_tenant(r, "beta")
    soon = time.time() + 60
    old = store.issue_key(r, "acme", expires_at=soon)
    _, info = store.rotate_key(r, "acme", key_digest(old), grace_s=3600)
    assert info.expires_at == pytest.approx(soon, abs=0.01)
    with pytest.raises(store.KeyNotFound, match="beta"):
        store.rotate_key(r, "beta", key_digest(old), grace_s=1)  # another tenant's key
