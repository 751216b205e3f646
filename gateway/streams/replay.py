"""Replay of a stream's event log from any gateway: the events after a given one, then the live tail until the
log ends, its gateway is lost, or the reader's deadline passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.streams.event_log import DATA, END, FIRST, FLUSH_S, entry_id, gateway_lost, live_key, log_key
from gateway.streams.resumable import framed
from gateway.telemetry import gateway_metrics
from gateway.web import api_errors
from gateway.web.api_errors import ApiError
from gateway.web.sse import event, event_named

POLL_S = 0.05  # a tailing reader looks for new events this often (one XRANGE; no connection held meanwhile)
LIVE_CHECK_S = 0.1  # ... and whether the stream's gateway still carries it this often
APPEAR_S = 4 * FLUSH_S  # a stream whose first events are not flushed yet: wait this long before a 404
BATCH = 256  # entries read per XRANGE


def stream_not_found(stream_id: str) -> ApiError:
    return ApiError(404, f"No stream with id '{stream_id[:64]}' to resume (unknown, another tenant's, or "
                    "expired).", param="Last-Event-ID", code="stream_not_found")


def split(joined: bytes) -> list[bytes]:
    """The events of one log entry (each ends with the blank line that closes an SSE event)."""
    return [part + b"\n\n" for part in joined.split(b"\n\n")[:-1]]


class Replay:
    """One reader of one stream's log (the tenant comes from the caller's key: another tenant's is a 404)."""

    def __init__(self, client: Any, tenant: str, stream_id: str, after: int, *, id_prefix: str = "",
                 responses: bool = False, deadline_s: float = 600.0,
                 carry: Callable[[str, str], Awaitable[bool]] | None = None) -> None:
        self.redis, self.tenant, self.stream_id = client, tenant, stream_id
        self.after, self.prefix, self.responses = after, id_prefix.encode(), responses
        self.key = log_key(tenant, stream_id)
        self.deadline = time.monotonic() + deadline_s
        self.carry = carry  # `CarryOn.claim`: a lost stream is carried on (here or by another gateway)
        # time.monotonic() until which a log not written yet may still start (a queued run)
        self.starts_by = 0.0

    async def check(self) -> None:
        """404 when there is no such log (after APPEAR_S), 400 when the events after `after` were trimmed."""
        until = time.monotonic() + APPEAR_S
        while not await self.redis.exists(self.key, live_key(self.tenant, self.stream_id)):
            if time.monotonic() >= until:
                raise api_errors.response_not_found(self.stream_id) if self.responses \
                    else stream_not_found(self.stream_id)
            await asyncio.sleep(FLUSH_S)
        first = await self.redis.xrange(self.key, count=1)
        if first and FIRST in first[0][1] and int(first[0][1][FIRST]) > self.after + 1:
            raise api_errors.invalid(f"Events up to {int(first[0][1][FIRST]) - 1} of this stream are no "
                                     "longer kept; resume from a later one.",
                                     param="starting_after" if self.responses else "Last-Event-ID")

    async def events(self) -> AsyncIterator[bytes]:
        """The framed events after `after`, then the tail; an error event when the stream cannot end whole."""
        cursor, last, checked = entry_id(self.after), self.after, time.monotonic()
        while True:
            entries = await self.redis.xrange(self.key, min="(" + cursor, count=BATCH)
            for eid, fields in entries:
                cursor = eid.decode() if isinstance(eid, bytes) else eid
                if END in fields:
                    if fields[END] != b"done":
                        yield self._error("stream_cut", "The stream stopped before it finished.")
                    gateway_metrics.current().stream_resumes.labels("done" if fields[END] == b"done"
                                                                    else "cut").inc()
                    return
                for seq, data in enumerate(split(fields[DATA]), int(fields[FIRST])):
                    if seq > last:  # a retried flush may hold events an earlier entry has
                        last = seq
                        yield framed(self.prefix + str(seq).encode(), data)
            if entries:
                continue
            now = time.monotonic()
            if now >= self.deadline:
                yield self._error("stream_timeout", "The stream did not end within the request deadline.")
                gateway_metrics.current().stream_resumes.labels("timeout").inc()
                return
            if now - checked >= LIVE_CHECK_S:
                checked = now
                if now < self.starts_by and not await self.redis.exists(self.key):
                    pass  # a queued background run: its log starts with its first token
                elif await gateway_lost(self.redis, self.tenant, self.stream_id) \
                        and not await self.redis.xrange(self.key, min="(" + cursor, count=1):
                    if self.carry is not None and await self.carry(self.tenant, self.stream_id):
                        continue  # its events come on in the log
                    yield self._error("stream_lost", "The gateway carrying this stream was lost before it "
                                      "finished; create the request again.")
                    gateway_metrics.current().stream_resumes.labels("lost").inc()
                    return
            await asyncio.sleep(POLL_S)

    def _error(self, code: str, message: str) -> bytes:
        if self.responses:
            return event_named("error", {"type": "error", "code": code, "message": message, "param": None})
        return event({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
