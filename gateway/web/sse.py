"""Server-sent events framing, and a streaming response whose clean-up runs however the response ends.

A plain `StreamingResponse` never starts its iterator when the client left first, so its clean-up
would never run. A client that stops reading is cut after a write deadline, so it cannot hold a
worker slot and its tenant's lease forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger("switchyard.gateway")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# uvicorn's line when an app returns mid-response; it then closes the connection, which is the point here
_INCOMPLETE = "ASGI callable returned without completing response."
_CUT: ContextVar[bool] = ContextVar("switchyard_stream_cut", default=False)


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def event_named(kind: str, obj: dict) -> bytes:
    """A typed event (`event: <kind>` then its data), as the Responses API streams them."""
    return b"event: " + kind.encode() + b"\n" + event(obj)


def stalled_cut() -> bool:
    """Whether this task's stream was cut because its client stopped reading (not because it left)."""
    return _CUT.get()


class WriteStalled(Exception):
    """The client did not take a chunk within the write deadline."""


class SSEResponse(StreamingResponse):
    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None, write_timeout_s: float = 30.0) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self._on_close = on_close
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_by_deadline(message: Message) -> None:
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise WriteStalled() from None

        try:
            await super().__call__(scope, receive, send_by_deadline)
        except WriteStalled:
            # Returning mid-response makes the server close the connection.
            _CUT.set(True)
            log.warning("client stopped reading for %gs; stream cut", self._write_timeout_s)
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                await closer()
            await self._on_close()


class QuietCutFilter(logging.Filter):
    """Drops uvicorn's error line for a stream this module cut on purpose (it is logged as a warning)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_CUT.get() and record.getMessage() == _INCOMPLETE)


def install_log_filter() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietCutFilter) for f in logger.filters):
        logger.addFilter(QuietCutFilter())
