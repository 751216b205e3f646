"""Stored responses in a real Redis: per-tenant keys (another tenant's id is a miss), a TTL, the count bound
per tenant (the oldest go), and the size bound (a larger response is not stored)."""

from __future__ import annotations

import pytest

from gateway.responses.response_store import ResponseStore
from tenancy.redis_client import async_client, sync_client


def body(i: int, text: str = "x") -> dict:
    return {"id": f"resp_{i}", "object": "response", "output": [{"content": [{"text": text}]}]}


@pytest.fixture()
async def store(redis_url):
    client = async_client(redis_url)
    yield ResponseStore(client, ttl_s=60, max_per_tenant=3, max_bytes=2_000)
    await client.aclose()


async def test_bounds_and_tenant_scope(store, redis_url):
    for i in range(5):
        assert await store.save("acme", body(i), [], [{"role": "user", "content": "q"}])
    assert ([await store.get("acme", f"resp_{i}") is not None for i in range(5)]
            == [False, False, True, True, True])
    assert await store.get("other", "resp_4") is None  # keys live under the tenant's hash tag
    r = sync_client(redis_url)
    assert 0 < r.ttl("{t:acme}:resp:resp_4") <= 60 and r.zcard("{t:acme}:resps") == 3
    assert not await store.save("acme", body(9, "y" * 5_000), [], [])  # over the size bound: not stored
    assert await store.get("acme", "resp_9") is None
    assert await store.delete("acme", "resp_4") and not await store.delete("acme", "resp_4")
    assert r.zcard("{t:acme}:resps") == 2
    r.close()
