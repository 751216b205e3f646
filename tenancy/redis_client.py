"""Redis client factories with short timeouts that are never retried, for one server or a Redis Cluster.

A slow or dead Redis must surface as `QuotaServiceUnavailable` within the request's deadline. The URL form
(`redis://` or `redis+cluster://host:port[,host:port]`) picks the client: `common.redis_url`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from common.redis_url import async_redis, is_cluster_url, sync_redis

REQUEST_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 32  # per gateway process (per cluster node with a cluster)
POOL_WAIT_S = 1.0  # waiting for a free connection; then ConnectionError -> quota service unavailable
CLI_TIMEOUT_S = 5.0
# The gateway never retries a cluster command (a timed-out script may have run): after a connection error the
# client re-reads the topology on its next command. MOVED and ASK are followed within one command.
CLUSTER_RETRIES = 0
CLI_CLUSTER_RETRIES = 1


class BoundedRedisCluster(aredis.RedisCluster):
    """redis-py's asyncio cluster client with the single-server pool's bound: at most MAX_CONNECTIONS
    commands in flight, a burst waiting up to POOL_WAIT_S for a turn (the plain client would raise
    MaxConnectionsError at once, a spurious 503).

    Commands wait while the topology is (re)read: redis-py 8.1 lets a burst of first commands run beside
    its initialization, which closes connections under them (AttributeError, "Connection closed")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turns = asyncio.Semaphore(MAX_CONNECTIONS)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            try:
                await self.initialize()
            except RedisClusterException as exc:  # no seed node reachable: unavailable, not a bug
                raise RedisConnectionError(f"Redis Cluster unreachable: {exc}") from None
        if self._turns.locked():
            try:
                await asyncio.wait_for(self._turns.acquire(), POOL_WAIT_S)
            except TimeoutError:
                raise RedisConnectionError("no free Redis Cluster connection") from None
        else:
            await self._turns.acquire()
        try:
            return await super().execute_command(*args, **kwargs)
        except (AttributeError, RuntimeError) as exc:
            # redis-py 8.1's race: after a timeout it disconnects a node's idle connections while another
            # command takes one of them and writes to it (`'NoneType' object has no attribute 'writelines'`,
            # or uvloop's "unable to perform operation on <TCPTransport closed=True ...>").
            if isinstance(exc, RuntimeError) and "closed" not in str(exc):
                raise
            raise RedisConnectionError(f"Redis Cluster connection closed under the command: {exc}") from None
        finally:
            self._turns.release()


def async_client(url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> aredis.Redis:
    """asyncio client for the gateway's per-request calls.

    The pool is bounded: a burst waits (up to POOL_WAIT_S) for one of MAX_CONNECTIONS connections, since
    opening one each on a saturated event loop outruns the socket timeout (spurious 503s).
    """
    if is_cluster_url(url):
        return async_redis(url, cluster_class=BoundedRedisCluster, max_connections=MAX_CONNECTIONS,
                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                           retry=AsyncRetry(NoBackoff(), CLUSTER_RETRIES))
    pool = aredis.BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return aredis.Redis.from_pool(pool)


def sync_client(url: str, timeout_s: float = CLI_TIMEOUT_S) -> redis.Redis:
    """Blocking client for CLI commands and tests (a `redis.cluster.RedisCluster` for a cluster URL)."""
    if is_cluster_url(url):
        return sync_redis(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                          retry=Retry(NoBackoff(), CLI_CLUSTER_RETRIES))
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
