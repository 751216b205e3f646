"""Batch records in Redis: the batch object (under the tenant's hash tag, so another tenant's id is a miss),
its per-line results (HSETNX: written once however often a line runs) and the shared line stream."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tenancy import tag

STREAM = "{batches}:lines"  # every batch line of the deployment, read by all gateways through one group
GROUP = "runners"
TTL_S = 30 * 86_400  # a batch object is kept as long as a stored response
MAX_PER_TENANT = 100  # batches kept per tenant (a create past it is a 400 naming input_file_id)
WINDOW_S = {"24h": 86_400}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(slots=True)
class Batch:
    """OpenAI's batch object, as stored (`tenant` is not shown to clients)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    total: int = 0
    metadata: dict[str, str] | None = None
    errors: dict | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_counts"] = d.pop("counts")
        del d["total"]
        return {"object": "batch", **d}


def new_batch_id() -> str:
    return f"batch_{time.time_ns() // 1000:013x}{secrets.token_hex(6)}"


def _key(tenant: str, batch_id: str) -> str:
    return tag(tenant) + f":batch:{batch_id}"


def _results(tenant: str, batch_id: str) -> str:
    return tag(tenant) + f":batch:{batch_id}:results"


def _index(tenant: str) -> str:
    return tag(tenant) + ":batches"


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class BatchStore:
    """Batch objects, their results and the line stream in one Redis (`redis.asyncio` client)."""

    def __init__(self, client: Any, *, max_per_tenant: int = MAX_PER_TENANT, ttl_s: int = TTL_S) -> None:
        self.redis, self.max_per_tenant, self.ttl_s = client, max_per_tenant, ttl_s

    async def count(self, tenant: str) -> int:
        await self.redis.zremrangebyscore(_index(tenant), 0, time.time() - self.ttl_s)
        return int(await self.redis.zcard(_index(tenant)))

    async def save(self, tenant: str, batch: Batch) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.set(_key(tenant, batch.id), json.dumps(asdict(batch)), ex=self.ttl_s)
            p.zadd(_index(tenant), {batch.id: batch.created_at})
            await p.execute()

    async def get(self, tenant: str, batch_id: str) -> Batch | None:
        if not batch_id.startswith("batch_") or len(batch_id) > 64:
            return None
        raw = await self.redis.get(_key(tenant, batch_id))
        return None if raw is None else Batch(**json.loads(raw))

    async def ids(self, tenant: str) -> list[str]:
        return [_text(x) for x in await self.redis.zrange(_index(tenant), 0, -1)]

    async def enqueue(self, tenant: str, batch_id: str, offsets: list[int]) -> None:
        """One stream entry per line (its index and byte offset in the input file); acknowledged entries are
        deleted, so the stream holds at most the lines of the batches in progress."""
        async with self.redis.pipeline(transaction=False) as p:
            for n, offset in enumerate(offsets):
                p.xadd(STREAM, {"t": tenant, "b": batch_id, "n": n, "o": offset})
            await p.execute()

    async def put_result(self, tenant: str, batch_id: str, n: int, result: dict) -> bool:
        """Record line `n`'s result unless one is there already; True when this call wrote it."""
        key = _results(tenant, batch_id)
        written = bool(await self.redis.hsetnx(key, str(n), json.dumps(result)))
        if written:
            await self.redis.expire(key, self.ttl_s)
        return written

    async def has_result(self, tenant: str, batch_id: str, n: int) -> bool:
        return bool(await self.redis.hexists(_results(tenant, batch_id), str(n)))

    async def result_count(self, tenant: str, batch_id: str) -> int:
        return int(await self.redis.hlen(_results(tenant, batch_id)))

    async def results(self, tenant: str, batch_id: str) -> dict[int, dict]:
        raw = await self.redis.hgetall(_results(tenant, batch_id))
        return {int(_text(k)): json.loads(v) for k, v in raw.items()}

    async def claim_finalize(self, tenant: str, batch_id: str) -> bool:
        """One gateway writes a batch's files: the first to ask (the claim expires if it dies meanwhile)."""
        return bool(await self.redis.set(_key(tenant, batch_id) + ":final", "1", nx=True, ex=300))

    async def update(self, tenant: str, batch_id: str, only_from: tuple[str, ...] = (),
                     **changes: Any) -> Batch | None:
        """Read-modify-write of the batch object under WATCH (a concurrent change retries); with `only_from`,
        it changes only a batch in one of those statuses (the batch as it is is returned otherwise)."""
        key = _key(tenant, batch_id)
        for _ in range(20):
            async with self.redis.pipeline(transaction=True) as p:
                await p.watch(key)
                raw = await p.get(key)
                if raw is None:
                    return None
                doc = json.loads(raw)
                if only_from and doc["status"] not in only_from:
                    return Batch(**doc)
                doc.update(changes)
                p.multi()
                p.set(key, json.dumps(doc), keepttl=True)
                try:
                    await p.execute()
                except Exception as exc:  # WatchError: someone else changed it
                    if type(exc).__name__ != "WatchError":
                        raise
                    continue
                return Batch(**doc)
        raise RuntimeError("batch record kept changing")
