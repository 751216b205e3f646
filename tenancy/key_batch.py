"""Look-ups of unknown API keys batched: the digests asked for in one event-loop turn (a flood's pipelined
requests arrive together) go to Redis as one pipeline of HMGETs, one round trip and one client call per batch
instead of per key."""

from __future__ import annotations

import asyncio
from typing import Any

from tenancy.schema import KEY_FIELDS, api_key_key

MAX_BATCH = 64  # digests per pipeline; more in one turn start another batch


class KeyBatcher:
    def __init__(self, client: Any) -> None:
        self._redis = client
        self._pending: dict[str, asyncio.Future[list]] = {}
        self._tasks: set[asyncio.Task] = set()

    def record(self, digest: str) -> asyncio.Future[list]:
        """The raw values of the key record's `KEY_FIELDS` (a None tenant: no such key), read with this
        turn's other digests."""
        fut = self._pending.get(digest)
        if fut is None:
            loop = asyncio.get_running_loop()
            if not self._pending:
                loop.call_soon(self._flush)
            fut = self._pending[digest] = loop.create_future()
            if len(self._pending) >= MAX_BATCH:
                self._flush()
        return fut

    def _flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        task = asyncio.ensure_future(self._read(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, batch: dict[str, asyncio.Future[list]]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for digest in batch:
                pipe.hmget(api_key_key(digest), KEY_FIELDS)
            owners = await pipe.execute()
        except BaseException as exc:  # every waiter of the batch gets the error (cancellation included)
            for fut in batch.values():
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError("cancelled"))
            if not isinstance(exc, Exception):
                raise
            return
        for fut, owner in zip(batch.values(), owners, strict=True):
            if not fut.done():
                fut.set_result(owner)
