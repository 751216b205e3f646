"""HTTP plumbing shared by the routes: request ids, bounded body reading, disconnect watching.

Bodies are checked while read (413, 408, 415, 400), so oversized, slow or malformed ones are refused,
never buffered whole or crashed on. Large bodies are decoded off the event loop with a cap on the numbers
they hold, so a huge token-id list is refused after `max_numbers` of them instead of parsed whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.telemetry.request_log import bind_request_id
from gateway.web.api_errors import body_too_large, invalid, request_timeout, unsupported_media_type

T = TypeVar("T")
CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# A JSON escape of a UTF-16 surrogate; only then can a parsed string hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
BODY_TIMEOUT_S = 10.0
THREAD_DECODE_BYTES = 64 * 1024  # bodies larger than this are decoded in a thread
THREAD_TOKENIZE_BYTES = 16 * 1024  # bodies from this size parse and tokenize on a thread
EARLY_DRAIN_BYTES = 64 * 1024  # an unread body this small is read and dropped after an early response
EARLY_DRAIN_S = 1.0  # ... if it all arrives within this; else the response closes the connection


class _NumberCap:
    """`parse_int`/`parse_float` hooks that count the numbers decoded and stop past `limit`.

    Being Python calls, they also let the decoding thread give up the GIL, so other streams keep going."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.count = limit, 0

    def _tick(self) -> None:
        self.count += 1
        if self.limit is not None and self.count > self.limit:
            raise _TooManyNumbers()

    def int(self, text: str) -> int:
        self._tick()
        return int(text)

    def float(self, text: str) -> float:
        self._tick()
        return float(text)


def bearer_key(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (None without one)."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class _TooManyNumbers(Exception):
    pass


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        rid = given if CLIENT_ID.match(given) else "req-" + uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        # for log lines (gateway.telemetry.request_log); the request's task owns this context
        bind_request_id(rid)
        raw_id = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", raw_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class CloseUnreadBodyMiddleware:
    """A response sent before its request's body was read (a 401, a 404): a small body already on its way is
    read and dropped first (at most EARLY_DRAIN_BYTES within EARLY_DRAIN_S), so the connection stays usable;
    otherwise the response closes the connection. Left open, the server would wait on the unread body with no
    deadline: a client trickling a byte now and then could hold a connection (and a descriptor) forever."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        read = headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers

        async def receive_tracked() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                read = True
            return message

        async def send_closing(message: Message) -> None:
            nonlocal read
            if message["type"] == "http.response.start" and not read:
                read = await drop_small_body(headers, receive)
                if not read:
                    message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        await self.app(scope, receive_tracked, send_closing)


async def drop_small_body(headers: dict[bytes, bytes], receive: Receive) -> bool:
    """Read and drop the rest of a request body that is small (at most EARLY_DRAIN_BYTES declared) and arrives
    within EARLY_DRAIN_S; True when the body is all read, False when some of it is still on its way."""
    declared = headers.get(b"content-length", b"0")
    if b"transfer-encoding" in headers or not declared.isdigit() or int(declared) > EARLY_DRAIN_BYTES:
        return False
    if declared == b"0":
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(EARLY_DRAIN_S):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return True
    return False


async def read_json(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S,
                    max_numbers: int | None = None) -> tuple[Any, bytes]:
    """The decoded JSON body and its bytes as sent; 413 past `limit`, 408 past `timeout_s`, 415/400 when
    not JSON, 400 (param `prompt`) when it holds more than `max_numbers` numbers."""
    _check_content_type(request.headers.get("content-type"))
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise body_too_large(limit)
    buf = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise body_too_large(limit)
    except TimeoutError:
        raise request_timeout(timeout_s) from None
    if len(buf) > THREAD_DECODE_BYTES:
        return await asyncio.to_thread(_decode_json, buf, max_numbers), bytes(buf)
    return _decode_json(buf, max_numbers), bytes(buf)


def _check_content_type(value: str | None) -> None:
    # No header is accepted (plain HTTP clients often omit it); a declared non-JSON type is refused.
    if value is None:
        return
    media = value.partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise unsupported_media_type(value)


def _decode_json(buf: bytearray, max_numbers: int | None = None) -> Any:
    cap = _NumberCap(max_numbers)
    try:
        # Strict UTF-8 first: json.loads(bytes) would let encoded surrogates through ('surrogatepass').
        body = json.loads(buf.decode("utf-8"), parse_int=cap.int, parse_float=cap.float)
    except _TooManyNumbers:
        raise invalid(f"The request holds more than {max_numbers} numbers: a prompt of token ids may hold at "
                      "most the model's context length.", param="prompt",
                      code="context_length_exceeded") from None
    except UnicodeDecodeError:
        raise invalid("The request body is not valid UTF-8.") from None
    except RecursionError:
        raise invalid("The request body is nested too deeply.") from None
    except ValueError:
        raise invalid("The request body is not valid JSON.") from None
    if _SURROGATE_ESCAPE.search(buf):
        try:  # paired escapes were joined into one character; a lone one cannot be encoded
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise invalid("The request body holds an unpaired UTF-16 surrogate escape "
                          "(\\ud800-\\udfff).") from None
    return body


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; raise ClientGone (after cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientGone()
    return task.result()
