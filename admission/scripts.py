"""Lua scripts shipped as package data, called with EVALSHA (one round trip) and reloaded on NOSCRIPT.

Reloading makes a Redis restart transparent; connection failures become `QuotaServiceUnavailable`.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import BusyLoadingError, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tenancy.errors import QuotaServiceUnavailable

# Errors meaning "Redis cannot answer now" (as opposed to a bug in a script or a call).
UNAVAILABLE_ERRORS = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)


class LuaScript:
    """One Lua script of `admission/lua/`, callable on an asyncio Redis client."""

    __slots__ = ("name", "source", "sha")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = resources.files("admission").joinpath("lua", f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(self, client: aredis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                await client.script_load(self.source)
                return await client.evalsha(self.sha, len(keys), *keys, *args)
        except UNAVAILABLE_ERRORS as exc:
            raise QuotaServiceUnavailable(f"quota store unreachable: {type(exc).__name__}") from None


RESERVE = LuaScript("reserve")
SETTLE = LuaScript("settle")
RENEW = LuaScript("renew")
HEARTBEAT = LuaScript("heartbeat")
