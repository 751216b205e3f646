"""prompt_cache_key steers routing inside the tenant's namespace, never across tenants."""

from __future__ import annotations

from types import SimpleNamespace

from router.dispatch import Router, RouteRequest
from router.placement.prefix import cache_key_route, namespace_root

SECRET = b"s" * 32


def test_cache_key_route_is_per_tenant():
    a = namespace_root("m", "v", "tenant-a", SECRET)
    b = namespace_root("m", "v", "tenant-b", SECRET)
    assert cache_key_route(a, SECRET, "k") == cache_key_route(a, SECRET, "k")
    assert cache_key_route(a, SECRET, "k") != cache_key_route(b, SECRET, "k")
    assert cache_key_route(a, SECRET, "k") != cache_key_route(a, SECRET, "k2")


def test_router_key_uses_cache_key_over_prefix():
    ns = namespace_root("m", "v", "t", SECRET)
    fake = SimpleNamespace(secret=SECRET, block_size=4, route_prefix_tokens=256)
    one = RouteRequest(rid="r", ns=ns, tokens=list(range(64)), cost=1, cache_key="conv")
    other = RouteRequest(rid="r", ns=ns, tokens=list(range(100, 164)), cost=1, cache_key="conv")
    assert Router.key_for(fake, one) == Router.key_for(fake, other) == cache_key_route(ns, SECRET, "conv")
    plain = RouteRequest(rid="r", ns=ns, tokens=list(range(64)), cost=1)
    assert Router.key_for(fake, plain) not in (None, Router.key_for(fake, one))
