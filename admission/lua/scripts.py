"""Lua scripts shipped as package data, called with EVALSHA (one round trip); on NOSCRIPT, run with EVAL.

EVAL goes to the node that owns the keys' slot and caches the script there, so a Redis restart, a failover or
a slot moved to a fresh Cluster node is transparent; connection failures become `QuotaServiceUnavailable`.
"""

from __future__ import annotations

import hashlib
import logging
from importlib import resources
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import (
    BusyLoadingError,
    ClusterError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tenancy.tenancy_errors import QuotaServiceUnavailable

log = logging.getLogger("switchyard.admission")

# Errors meaning "Redis cannot answer now" (as opposed to a bug in a script or a call); the Cluster ones: a
# slot with no known owner, redirections that did not settle (ClusterError: "TTL exhausted").
UNAVAILABLE_ERRORS = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError, SlotNotCoveredError)
# Error replies of a server that cannot take writes now: a replica after a failover (READONLY), out of
# memory (OOM), failing to persist (MISCONF), a busy script, no quorum of replicas or a master link down.
UNAVAILABLE_REPLIES = ("READONLY", "OOM", "MISCONF", "BUSY", "NOREPLICAS", "MASTERDOWN", "TRYAGAIN",
                       "CLUSTERDOWN")


class LuaScript:
    """One Lua script of `admission/lua/`, callable on an asyncio Redis client."""

    __slots__ = ("name", "source", "sha")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = resources.files(__package__).joinpath(f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(self, client: aredis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:  # on the node that owns the slot (SCRIPT LOAD may go to another)
                return await client.eval(self.source, len(keys), *keys, *args)
        except UNAVAILABLE_ERRORS as exc:
            raise QuotaServiceUnavailable(f"quota store unreachable: {type(exc).__name__}") from None
        except ClusterError as exc:  # before ResponseError: ClusterDownError is both
            log.warning("quota store cluster refused %s: %s", self.name, str(exc)[:200])
            raise QuotaServiceUnavailable(f"quota store unreachable: {type(exc).__name__}") from None
        except ResponseError as exc:
            if not is_unavailable_reply(exc):
                raise
            log.warning("quota store refused %s: %s", self.name, str(exc)[:200])
            raise QuotaServiceUnavailable(f"quota store refused the call: {str(exc)[:80]}") from None


def is_unavailable_reply(exc: ResponseError) -> bool:
    """True for an error reply that says the server cannot serve writes now (not a bug in the call)."""
    if isinstance(exc, ReadOnlyError):
        return True
    words = str(exc).split()
    return bool(words) and (words[0] in UNAVAILABLE_REPLIES or words[0].startswith("-") and
                            words[0][1:] in UNAVAILABLE_REPLIES)


RESERVE = LuaScript("reserve")
SETTLE = LuaScript("settle")
RENEW = LuaScript("renew")
CHARGE_INVALID = LuaScript("charge_invalid")
HEARTBEAT = LuaScript("heartbeat")
