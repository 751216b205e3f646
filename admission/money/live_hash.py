"""A Redis hash a gateway reads at most once per interval, so an operator's `HSET` applies within it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import redis.asyncio as aredis

T = TypeVar("T")
log = logging.getLogger("switchyard.admission")


class LiveHash(Generic[T]):
    """`parse(HGETALL key)`, never served older than `refresh_s`: past half of it a read starts in the
    background (requests keep the value they have), past all of it the caller waits for a read (concurrent
    callers share one)."""

    def __init__(self, client: aredis.Redis, key: str, parse: Callable[[dict], T], refresh_s: float) -> None:
        self.redis, self.key, self.parse, self.refresh_s = client, key, parse, refresh_s
        self._value = parse({})
        self._loaded = -float("inf")
        self._lock = asyncio.Lock()
        self._ahead: asyncio.Task | None = None  # the background read in flight

    async def value(self) -> T:
        age = time.monotonic() - self._loaded
        if age >= self.refresh_s:
            await self._read()
        elif age >= self.refresh_s / 2 and (self._ahead is None or self._ahead.done()):
            self._ahead = asyncio.ensure_future(self._read_ahead())
        return self._value

    async def _read(self) -> None:
        async with self._lock:
            started = time.monotonic()
            if started - self._loaded >= self.refresh_s / 2:
                self._value = self.parse(await self.redis.hgetall(self.key))
                self._loaded = started  # the age counts from before the read

    async def _read_ahead(self) -> None:
        try:
            await self._read()
        except Exception as exc:  # the next caller past the interval reads inline and sees the error
            log.debug("background read of %s failed: %s", self.key, type(exc).__name__)
