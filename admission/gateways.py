"""Registry of live gateways in Redis, so fail-open mode can split each tenant's limits between them.

The last live count is kept, so the split still holds while Redis is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import redis.asyncio as aredis

from admission.lua.scripts import HEARTBEAT
from tenancy.schema import GATEWAYS_KEY
from tenancy.tenancy_errors import QuotaServiceUnavailable

log = logging.getLogger("switchyard.admission")


class GatewayRegistry:
    """Heartbeats this gateway into Redis and remembers how many gateways are live."""

    def __init__(self, client: aredis.Redis, gateway_id: str | None = None, ttl_s: float = 10.0) -> None:
        self._redis = client
        self.gateway_id = gateway_id or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.ttl_s = ttl_s
        self.live_count = 1
        self._task: asyncio.Task | None = None

    async def beat(self) -> int:
        """Register once; returns (and remembers) the live gateway count. Raises QuotaServiceUnavailable."""
        count = await HEARTBEAT(self._redis, [GATEWAYS_KEY], [self.gateway_id, int(self.ttl_s * 1000)])
        self.live_count = max(1, int(count))
        return self.live_count

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-heartbeat")

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
            except QuotaServiceUnavailable:
                log.warning("gateway heartbeat failed; keeping live gateway count %d", self.live_count)
            await asyncio.sleep(self.ttl_s / 3)

    async def aclose(self) -> None:
        """Stop heartbeating and deregister (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.zrem(GATEWAYS_KEY, self.gateway_id), 1.0)
