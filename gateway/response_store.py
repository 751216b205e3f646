"""Stored responses (`store`, the default): each response's object, its input items and the conversation so far
(for `previous_response_id`) in Redis under the tenant's hash tag, so another tenant's id is a miss (404), with a
TTL, a per-tenant count bound (oldest dropped) and a size bound per response (a larger one is not stored)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

log = logging.getLogger("switchyard.gateway")

TTL_S = 30 * 86_400  # as OpenAI keeps responses
MAX_PER_TENANT = 1_000
MAX_BYTES = 1 << 20


def _key(tenant: str, response_id: str) -> str:
    return f"{{t:{tenant}}}:resp:{response_id}"


def _index(tenant: str) -> str:
    return f"{{t:{tenant}}}:resps"


class ResponseStore:
    def __init__(self, client: Any, *, ttl_s: int = TTL_S, max_per_tenant: int = MAX_PER_TENANT,
                 max_bytes: int = MAX_BYTES) -> None:
        self._redis = client
        self.ttl_s, self.max_per_tenant, self.max_bytes = ttl_s, max_per_tenant, max_bytes

    async def save(self, tenant: str, response: dict, input_items: list[dict], conversation: list[dict]) -> bool:
        """Store one finished response; False (nothing stored) when it is over the size bound."""
        blob = json.dumps({"response": response, "input_items": input_items, "conversation": conversation},
                          separators=(",", ":"))
        if len(blob) > self.max_bytes:
            log.info("response %s not stored: %d bytes over the %d bound", response["id"], len(blob), self.max_bytes)
            return False
        idx = _index(tenant)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(_key(tenant, response["id"]), blob, ex=self.ttl_s)
        pipe.zadd(idx, {response["id"]: time.time()})
        pipe.zremrangebyscore(idx, "-inf", time.time() - self.ttl_s)  # ids whose objects expired
        pipe.expire(idx, self.ttl_s)
        pipe.zcard(idx)
        *_, count = await pipe.execute()
        if count > self.max_per_tenant:
            old = await self._redis.zrange(idx, 0, count - self.max_per_tenant - 1)
            if old:
                await self._redis.delete(*[_key(tenant, (o.decode() if isinstance(o, bytes) else o)) for o in old])
                await self._redis.zrem(idx, *old)
        return True

    async def get(self, tenant: str, response_id: str) -> dict | None:
        raw = await self._redis.get(_key(tenant, response_id))
        return None if raw is None else json.loads(raw)

    async def delete(self, tenant: str, response_id: str) -> bool:
        gone = await self._redis.delete(_key(tenant, response_id))
        await self._redis.zrem(_index(tenant), response_id)
        return bool(gone)
