"""Server-sent events framing, and a streaming response whose clean-up runs however the response ends.

A plain `StreamingResponse` never starts its iterator when the client left first, so its clean-up
would never run.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
