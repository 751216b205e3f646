"""A Redis hash a gateway reads at most once per interval, so an operator's `HSET` applies within it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import redis.asyncio as aredis

T = TypeVar("T")


class LiveHash(Generic[T]):
    """`parse(HGETALL key)`, read again once it is `refresh_s` old (concurrent callers share one read)."""

    def __init__(self, client: aredis.Redis, key: str, parse: Callable[[dict], T], refresh_s: float) -> None:
        self.redis, self.key, self.parse, self.refresh_s = client, key, parse, refresh_s
        self._value = parse({})
        self._loaded = -float("inf")
        self._lock = asyncio.Lock()

    async def value(self) -> T:
        if time.monotonic() - self._loaded >= self.refresh_s:
            async with self._lock:
                started = time.monotonic()
                if started - self._loaded >= self.refresh_s:
                    self._value = self.parse(await self.redis.hgetall(self.key))
                    self._loaded = started  # the age counts from before the read
        return self._value
