"""Redis client factories with short timeouts that are never retried.

A slow or dead Redis must surface as `QuotaServiceUnavailable` within the request's deadline.
"""

from __future__ import annotations

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

REQUEST_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 32  # per gateway process
POOL_WAIT_S = 1.0  # waiting for a free connection; then ConnectionError -> quota service unavailable
CLI_TIMEOUT_S = 5.0


def async_client(url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> aredis.Redis:
    """asyncio client for the gateway's per-request calls.

    The pool is bounded: a burst waits (up to POOL_WAIT_S) for one of MAX_CONNECTIONS connections, since
    opening one each on a saturated event loop outruns the socket timeout (spurious 503s).
    """
    pool = aredis.BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return aredis.Redis.from_pool(pool)


def sync_client(url: str, timeout_s: float = CLI_TIMEOUT_S) -> redis.Redis:
    """Blocking client for CLI commands and tests."""
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
