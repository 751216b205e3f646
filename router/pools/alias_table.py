"""Aliases as live-editable Redis records (hash `sy:aliases`: alias -> JSON of version
-> weight), polled so an edit applies on every gateway within a poll interval; a
malformed record is logged and the last good one stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from router.pools.aliases import Alias, parse_alias

log = logging.getLogger(__name__)

ALIASES_KEY = "sy:aliases"
DEFAULT_POLL_S = 0.5
READ_TIMEOUT_S = 1.0
MAX_ALIASES = 1000


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class AliasTable:
    """The aliases in force: the last good record of each, refreshed every `poll_s` from Redis."""

    def __init__(self, redis: Any, *, poll_s: float = DEFAULT_POLL_S) -> None:
        self._redis = redis  # an asyncio Redis (or cluster) client
        self.poll_s = poll_s
        self._good: dict[str, Alias] = {}
        self._raw: dict[str, str] = {}  # last raw record seen per alias (good or not): log a bad one once
        self._task: asyncio.Task[None] | None = None
        self._ok = True

    def get(self, name: str) -> Alias | None:
        return self._good.get(name)

    def names(self) -> list[str]:
        return sorted(self._good)

    def broken(self, name: str) -> bool:
        """A record of `name` exists but none of it was ever good (an operator's mistake, not the
        client's)."""
        return name in self._raw and name not in self._good

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="sy-aliases")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:  # never let one bad poll end the watch
                log.exception("alias refresh failed")

    async def refresh(self) -> None:
        """One read of every alias record; on a Redis error the aliases in force stay."""
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                records = await self._redis.hgetall(ALIASES_KEY)
        except Exception as exc:
            if self._ok:
                log.warning("aliases unreadable, keeping the last ones: %s", exc)
            self._ok = False
            return
        self._ok = True
        self.apply({_text(k): _text(v) for k, v in records.items()})

    def apply(self, records: dict[str, str]) -> None:
        """Take a full read of the records: new and changed ones parsed, deleted ones dropped."""
        for name in [n for n in self._raw if n not in records]:
            self._raw.pop(name)
            if self._good.pop(name, None) is not None:
                log.info("alias %s removed", name)
        for name, raw in sorted(records.items())[:MAX_ALIASES]:
            if self._raw.get(name) == raw:
                continue
            self._raw[name] = raw
            try:
                alias = parse_alias(name, raw)
            except ValueError as exc:
                kept = "the last good record stays" if name in self._good else "it is not in force"
                log.warning("malformed alias record %s (%s); %s", name, exc, kept)
                continue
            self._good[name] = alias
            log.info("alias %s -> %s", name, dict(alias.targets))
