"""The gateway's view of tenants: API key -> `Tenant`, cached in-process for a short TTL.

The TTL bounds both the Redis reads per key and how long a revoked key or an edited quota takes to apply.
A cached key carries its expiry and is checked against the wall clock on every use, so it never outlives it.
Unknown keys are cached apart and their Redis look-ups capped, so a flood of made-up keys cannot evict
real ones or take the Redis pool from them.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisClusterException, RedisError

from tenancy import apikeys
from tenancy.key_batch import KeyBatcher
from tenancy.schema import (
    KEY_FIELDS,
    KeyRecord,
    Tenant,
    api_key_key,
    config_key,
    parse_key_record,
    parse_tenant,
)
from tenancy.tenancy_errors import QuotaServiceUnavailable

# The shape every issued key has (`apikeys.new_api_key`): anything else is refused before any cache or Redis.
_KEY_SHAPE = re.compile(re.escape(apikeys.KEY_PREFIX) + f"[A-Za-z0-9_-]{{{apikeys.KEY_RANDOM_CHARS}}}")


def key_shape_ok(api_key: str) -> bool:
    """`api_key` has the shape of a key this system issues (anything else is unknown without a look-up)."""
    return _KEY_SHAPE.fullmatch(api_key) is not None


@dataclass(slots=True)
class _Entry:
    value: Any
    fresh_until: float
    stale_until: float


class _TTLCache:
    """A bounded LRU of entries that are fresh for `ttl_s` and usable as stale for `stale_s`; O(1) per
    call."""

    def __init__(self, ttl_s: float, stale_s: float, max_entries: int) -> None:
        self.ttl_s, self.stale_s, self.max_entries = ttl_s, stale_s, max_entries
        self._data: OrderedDict[str, _Entry] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str, now: float, allow_stale: bool = False) -> _Entry | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        if now < entry.fresh_until or (allow_stale and now < entry.stale_until):
            self._data.move_to_end(key)
            return entry
        return None

    def put(self, key: str, value: Any, now: float) -> None:
        self._data[key] = _Entry(value, now + self.ttl_s, now + self.stale_s)
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)  # least recently used

    def discard(self, key: str) -> None:
        self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()


class TenantDirectory:
    """API key -> Tenant for the gateway, cached briefly; see the module docstring.

    A key the gateway has not seen resolve to a tenant (not in the known-key cache) is looked up under a
    cap of `max_unknown_lookups` concurrent Redis reads; past `unknown_wait_s` waiting for one it gets
    `QuotaServiceUnavailable` (503 with retry-after). Known keys never wait for that cap.
    """

    def __init__(self, client: aredis.Redis, *, ttl_s: float = 0.5, stale_s: float = 300.0,
                 max_entries: int = 10_000, max_unknown_entries: int = 10_000, unknown_ttl_s: float = 0.5,
                 max_unknown_lookups: int = 8, unknown_wait_s: float = 0.1,
                 serve_stale_on_error: bool = False, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        if not 0 < ttl_s <= 0.5 or not 0 < unknown_ttl_s <= 0.5:
            raise ValueError("ttl_s and unknown_ttl_s must be in (0, 0.5] so changes show within 1 s")
        self._redis = client
        self._keys = _TTLCache(ttl_s, stale_s, max_entries)                       # digest -> KeyRecord
        self._unknown = _TTLCache(unknown_ttl_s, unknown_ttl_s, max_unknown_entries)  # digest -> None
        self._tenants = _TTLCache(ttl_s, stale_s, max_entries)                    # name -> Tenant | None
        self._lookups = asyncio.Semaphore(max_unknown_lookups)
        self._batch = KeyBatcher(client)
        self._unknown_wait_s = unknown_wait_s
        self._inflight: dict[str, asyncio.Future] = {}
        self._serve_stale = serve_stale_on_error
        self._clock = clock
        self._wall = wall  # unix seconds, for key expiry

    async def authenticate(self, api_key: str | None) -> Tenant | None:
        """The active tenant owning `api_key` as the key sees it (its model scope applied), or None for a
        missing, unknown, expired, revoked or disabled key."""
        if not api_key or not key_shape_ok(api_key):
            return None
        return await self.key_tenant(apikeys.digest(api_key))

    async def key_tenant(self, digest: str) -> Tenant | None:
        """`authenticate` by the key's SHA-256 digest (a carried-on stream knows only that)."""
        record = await self._live_key(digest)
        if record is None:
            return None
        tenant = await self.tenant(record.tenant)
        return record.scoped(tenant) if tenant is not None and tenant.active else None

    async def tenant(self, name: str) -> Tenant | None:
        """The tenant's current config (active or not), or None if it does not exist."""
        entry = self._tenants.get(name, self._clock())
        if entry is not None:
            return entry.value
        return await self._shared("t:" + name, lambda: self._load_tenant(name))

    async def key_owner(self, digest: str) -> str | None:
        """The tenant holding the key of this SHA-256 digest, or None once it is revoked or expired (cached
        like look-ups)."""
        record = await self._live_key(digest)
        return None if record is None else record.tenant

    def invalidate(self) -> None:
        self._keys.clear()
        self._unknown.clear()
        self._tenants.clear()

    async def _live_key(self, digest: str) -> KeyRecord | None:
        record = await self._key_record(digest)
        return record if record is not None and record.live(self._wall()) else None

    async def _key_record(self, digest: str) -> KeyRecord | None:
        now = self._clock()
        entry = self._keys.get(digest, now)
        if entry is not None:
            return entry.value
        if self._unknown.get(digest, now) is not None:
            return None
        if digest in self._keys:  # known (its entry expired): refresh without waiting for the cap
            return await self._shared("k:" + digest, lambda: self._load_key(digest))
        return await self._shared("k:" + digest, lambda: self._load_unknown_key(digest))

    async def _load_unknown_key(self, digest: str) -> KeyRecord | None:
        if not self._lookups.locked():
            # a free slot: taken at once, no timer (the common case, even in a flood)
            await self._lookups.acquire()
        else:
            try:
                await asyncio.wait_for(self._lookups.acquire(), self._unknown_wait_s)
            except TimeoutError:
                raise QuotaServiceUnavailable("too many concurrent look-ups of unknown API keys") from None
        try:
            return await self._load_key(digest, batched=True)
        finally:
            self._lookups.release()

    async def _load_key(self, digest: str, batched: bool = False) -> KeyRecord | None:
        try:
            if batched:  # an unknown key: read with this turn's others (`KeyBatcher`)
                values = await asyncio.shield(self._batch.record(digest))
            else:
                values = await self._redis.hmget(api_key_key(digest), KEY_FIELDS)
        except (RedisError, RedisClusterException, OSError) as exc:
            stale = self._keys.get(digest, self._clock(), allow_stale=True) if self._serve_stale else None
            if stale is not None:
                return stale.value
            raise QuotaServiceUnavailable(f"tenant store unreachable: {type(exc).__name__}") from None
        now = self._clock()
        record = parse_key_record(values)
        if record is None:
            self._keys.discard(digest)
            self._unknown.put(digest, None, now)
            return None
        self._unknown.discard(digest)
        self._keys.put(digest, record, now)
        return record

    async def _load_tenant(self, name: str) -> Tenant | None:
        try:
            fields = await self._redis.hgetall(config_key(name))
        except (RedisError, RedisClusterException, OSError) as exc:
            stale = self._tenants.get(name, self._clock(), allow_stale=True) if self._serve_stale else None
            if stale is not None:
                return stale.value
            raise QuotaServiceUnavailable(f"tenant store unreachable: {type(exc).__name__}") from None
        tenant = parse_tenant(name, fields) if fields else None
        self._tenants.put(name, tenant, self._clock())
        return tenant

    async def _shared(self, flight_key: str, load: Callable[[], Awaitable[Any]]) -> Any:
        """Concurrent misses of one key share one Redis read."""
        fut = self._inflight.get(flight_key)
        if fut is None:
            fut = asyncio.ensure_future(load())
            self._inflight[flight_key] = fut
            fut.add_done_callback(lambda f: self._flight_done(flight_key, f))
        # shield: one caller being cancelled must not cancel the shared read of the others.
        return await asyncio.shield(fut)

    def _flight_done(self, flight_key: str, fut: asyncio.Future) -> None:
        self._inflight.pop(flight_key, None)
        if not fut.cancelled():
            fut.exception()  # mark retrieved even when every waiter was cancelled
