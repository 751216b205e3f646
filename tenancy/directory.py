"""The gateway's view of tenants: API key -> `Tenant`, cached in-process for a short TTL.

The TTL bounds both the Redis reads per key and how long a revoked key or an edited quota takes to apply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError

from tenancy import apikeys
from tenancy.errors import QuotaServiceUnavailable
from tenancy.schema import Tenant, api_key_key, config_key, parse_tenant


@dataclass(slots=True)
class _Entry:
    value: Any
    fresh_until: float
    stale_until: float


class _TTLCache:
    """A bounded dict of entries that are fresh for `ttl_s` and usable as stale for `stale_s`."""

    def __init__(self, ttl_s: float, stale_s: float, max_entries: int) -> None:
        self.ttl_s, self.stale_s, self.max_entries = ttl_s, stale_s, max_entries
        self._data: dict[str, _Entry] = {}

    def get(self, key: str, now: float, allow_stale: bool = False) -> _Entry | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        if now < entry.fresh_until or (allow_stale and now < entry.stale_until):
            return entry
        return None

    def put(self, key: str, value: Any, now: float) -> None:
        if len(self._data) >= self.max_entries and key not in self._data:
            self._evict(now)
        self._data[key] = _Entry(value, now + self.ttl_s, now + self.stale_s)

    def clear(self) -> None:
        self._data.clear()

    def _evict(self, now: float) -> None:
        for k in [k for k, e in self._data.items() if e.stale_until <= now]:
            del self._data[k]
        while len(self._data) >= self.max_entries:
            del self._data[next(iter(self._data))]  # oldest insertion


class TenantDirectory:
    """API key -> Tenant for the gateway, cached briefly; see the module docstring."""

    def __init__(self, client: aredis.Redis, *, ttl_s: float = 0.5, stale_s: float = 300.0,
                 max_entries: int = 10_000, serve_stale_on_error: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < ttl_s <= 0.5:
            raise ValueError("ttl_s must be in (0, 0.5] so changes show within 1 s")
        self._redis = client
        self._keys = _TTLCache(ttl_s, stale_s, max_entries)      # digest -> tenant name | None
        self._tenants = _TTLCache(ttl_s, stale_s, max_entries)   # name -> Tenant | None
        self._inflight: dict[str, asyncio.Future] = {}
        self._serve_stale = serve_stale_on_error
        self._clock = clock

    async def authenticate(self, api_key: str | None) -> Tenant | None:
        """The active tenant owning `api_key`, or None for a missing, unknown, revoked or disabled key."""
        if not api_key or not api_key.startswith(apikeys.KEY_PREFIX) or len(api_key) > 256:
            return None
        name = await self._cached(self._keys, "k:", apikeys.digest(api_key), self._read_key_owner)
        if name is None:
            return None
        tenant = await self.tenant(name)
        return tenant if tenant is not None and tenant.active else None

    async def tenant(self, name: str) -> Tenant | None:
        """The tenant's current config (active or not), or None if it does not exist."""
        return await self._cached(self._tenants, "t:", name, self._read_tenant)

    def invalidate(self) -> None:
        self._keys.clear()
        self._tenants.clear()

    async def _read_key_owner(self, digest: str) -> str | None:
        owner = await self._redis.hget(api_key_key(digest), "tenant")
        return owner.decode() if owner is not None else None

    async def _read_tenant(self, name: str) -> Tenant | None:
        fields = await self._redis.hgetall(config_key(name))
        return parse_tenant(name, fields) if fields else None

    async def _cached(self, cache: _TTLCache, ns: str, key: str,
                      load: Callable[[str], Awaitable[Any]]) -> Any:
        entry = cache.get(key, self._clock())
        if entry is not None:
            return entry.value
        flight_key = ns + key
        fut = self._inflight.get(flight_key)
        if fut is None:
            fut = asyncio.ensure_future(self._load(cache, key, load))
            self._inflight[flight_key] = fut
            fut.add_done_callback(lambda f: self._flight_done(flight_key, f))
        # shield: one caller being cancelled must not cancel the shared read of the others.
        return await asyncio.shield(fut)

    def _flight_done(self, flight_key: str, fut: asyncio.Future) -> None:
        self._inflight.pop(flight_key, None)
        if not fut.cancelled():
            fut.exception()  # mark retrieved even when every waiter was cancelled

    async def _load(self, cache: _TTLCache, key: str, load: Callable[[str], Awaitable[Any]]) -> Any:
        try:
            value = await load(key)
        except (RedisError, OSError) as exc:
            stale = cache.get(key, self._clock(), allow_stale=True) if self._serve_stale else None
            if stale is not None:
                return stale.value
            raise QuotaServiceUnavailable(f"tenant store unreachable: {type(exc).__name__}") from None
        cache.put(key, value, self._clock())
        return value
