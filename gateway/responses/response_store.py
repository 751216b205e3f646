"""Stored responses (`store`, the default): each response's object, its input items and the conversation so
far (for `previous_response_id`) in Redis under the tenant's hash tag, so another tenant's id is a miss (404),
with a TTL, a per-tenant count bound (oldest dropped) and a size bound per response (larger: not stored).

A background run also has a state key (`running`, `cancel` once a cancel was asked, then its final status):
its later saves go through a script that refuses any but `cancelled` after a cancel, from any gateway."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from tenancy import tag

log = logging.getLogger("switchyard.gateway")

TTL_S = 30 * 86_400  # as OpenAI keeps responses
MAX_PER_TENANT = 1_000
MAX_BYTES = 1 << 20


LOST_ERROR = {"code": "server_error", "message": "The gateway running this background response was lost "
              "before it finished; create it again."}


def reported(doc: dict) -> dict:
    """A stored response as clients see it: a background run past its deadline and still in progress has
    failed (its gateway died before it could record how it ended)."""
    resp = doc["response"]
    if resp["status"] in ("queued", "in_progress") and time.time() > doc.get("run_deadline", float("inf")):
        return {**resp, "status": "failed", "error": LOST_ERROR}
    return resp


def _key(tenant: str, response_id: str) -> str:
    return tag(tenant) + f":resp:{response_id}"


def _index(tenant: str) -> str:
    return tag(tenant) + ":resps"


def _run(tenant: str, response_id: str) -> str:
    return tag(tenant) + f":resp:{response_id}:run"


# KEYS: object, run state; ARGV: blob, status, ttl, final (1: the state becomes the status)
_SAVE_RUN = """
local state = redis.call('GET', KEYS[2])
if state == 'running' or ((state == 'cancel' or state == 'cancelled') and ARGV[2] == 'cancelled') then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
  if ARGV[4] == '1' then redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3]) end
  return 1
end
return 0
"""
# KEYS: run state; returns the state before (nil: no such run)
_CANCEL_RUN = """
local state = redis.call('GET', KEYS[1])
if state == 'running' then redis.call('SET', KEYS[1], 'cancel', 'KEEPTTL') end
return state
"""


class ResponseStore:
    def __init__(self, client: Any, *, ttl_s: int = TTL_S, max_per_tenant: int = MAX_PER_TENANT,
                 max_bytes: int = MAX_BYTES) -> None:
        self._redis = client
        self.ttl_s, self.max_per_tenant, self.max_bytes = ttl_s, max_per_tenant, max_bytes

    def _blob(self, response: dict, input_items: list[dict], conversation: list[dict],
              **extra: Any) -> str | None:
        blob = json.dumps({"response": response, "input_items": input_items, "conversation": conversation,
                           **extra}, separators=(",", ":"))
        if len(blob) > self.max_bytes:
            log.info("response %s not stored: %d bytes over the %d bound", response["id"], len(blob),
                     self.max_bytes)
            return None
        return blob

    async def save(self, tenant: str, response: dict, input_items: list[dict], conversation: list[dict],
                   *, run_deadline: float | None = None) -> bool:
        """Store one response; False (nothing stored) when it is over the size bound. With `run_deadline`
        (epoch seconds) it starts a background run: state `running`, later saves through `save_run`."""
        extra = {} if run_deadline is None else {"run_deadline": run_deadline}
        blob = self._blob(response, input_items, conversation, **extra)
        if blob is None:
            return False
        idx = _index(tenant)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(_key(tenant, response["id"]), blob, ex=self.ttl_s)
        if run_deadline is not None:
            pipe.set(_run(tenant, response["id"]), "running", ex=self.ttl_s)
        pipe.zadd(idx, {response["id"]: time.time()})
        pipe.zremrangebyscore(idx, "-inf", time.time() - self.ttl_s)  # ids whose objects expired
        pipe.expire(idx, self.ttl_s)
        pipe.zcard(idx)
        *_, count = await pipe.execute()
        await self._drop_oldest(tenant, count)
        return True

    async def _drop_oldest(self, tenant: str, count: int) -> None:
        idx = _index(tenant)
        if count > self.max_per_tenant:
            old = await self._redis.zrange(idx, 0, count - self.max_per_tenant - 1)
            if old:
                await self._redis.delete(*[_key(tenant, (o.decode() if isinstance(o, bytes) else o))
                                           for o in old])
                await self._redis.zrem(idx, *old)

    async def save_run(self, tenant: str, response: dict, input_items: list[dict], conversation: list[dict],
                       *, run_deadline: float, final: bool) -> bool:
        """Update a background run's response: refused (False) once it ended, or after a cancel unless the
        status is `cancelled`; `final` ends the run. False too when over the size bound."""
        blob = self._blob(response, input_items, conversation, run_deadline=run_deadline)
        if blob is None:
            return False
        rid = response["id"]
        saved = await self._redis.eval(_SAVE_RUN, 2, _key(tenant, rid), _run(tenant, rid), blob,
                                       response["status"], self.ttl_s, 1 if final else 0)
        return bool(saved)

    async def cancel_run(self, tenant: str, response_id: str) -> str | None:
        """Ask a running background run to stop: its state before (`running`: now `cancel`; None: no run)."""
        state = await self._redis.eval(_CANCEL_RUN, 1, _run(tenant, response_id))
        return state.decode() if isinstance(state, bytes) else state

    async def stop_asked(self, runs: list[tuple[str, str]]) -> list[bool]:
        """Which of these (tenant, response id) runs should stop: no longer `running` (a cancel from any
        gateway, or deleted)."""
        pipe = self._redis.pipeline(transaction=False)
        for tenant, rid in runs:
            pipe.get(_run(tenant, rid))
        return [state not in (b"running", "running") for state in await pipe.execute()]

    async def get(self, tenant: str, response_id: str) -> dict | None:
        raw = await self._redis.get(_key(tenant, response_id))
        return None if raw is None else json.loads(raw)

    async def delete(self, tenant: str, response_id: str) -> bool:
        gone = await self._redis.delete(_key(tenant, response_id), _run(tenant, response_id))
        await self._redis.zrem(_index(tenant), response_id)
        return bool(gone)
