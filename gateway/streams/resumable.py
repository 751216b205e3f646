"""A resumable SSE body: each event gets an `id:` and goes to the stream's event log; a client that leaves
does not stop the stream, which runs on detached for a grace window so that a reconnecting client can tail it
(a client that stops reading and is cut after the write deadline ends it as before).

A pump task drives the stream's own body (its generation) and hands each event to the client through a small
bounded queue; the client's disconnect cancels only the reader, never the generation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.streams.event_log import EventLogs, TokenSource
from gateway.web.sse import stalled_cut

log = logging.getLogger("switchyard.gateway")

# events waiting for a slow client; past it the generation waits (the write deadline cuts it)
QUEUE_EVENTS = 64
DETACH_GRACE_S = 30.0
WRITE_AHEAD_S = 1.0  # a carried stream's event waits this long at most for its log; then it is not carried
_EOF = object()


def framed(event_id: bytes, data: bytes) -> bytes:
    """An SSE event with its id line first (`data` is one event as the body yields it)."""
    return b"id: " + event_id + b"\n" + data


class ResumableStream:
    """Wraps one stream's body and its clean-up (`on_close`, run once, when the generation has ended)."""

    def __init__(self, logs: EventLogs, tenant: str, stream_id: str, inner: AsyncIterator[bytes],
                 on_close: Callable[[], Awaitable[None]], *, id_prefix: str = "",
                 detach_grace_s: float = DETACH_GRACE_S,
                 draining: Callable[[], bool] = lambda: False, source: TokenSource | None = None,
                 carry: bytes | None = None) -> None:
        self._logs, self._inner, self._on_close = logs, inner, on_close
        self._log = logs.open(tenant, stream_id, source=source, carry=carry)
        self._source = source
        self._prefix = id_prefix.encode()
        self._grace_s, self._draining = detach_grace_s, draining
        self._queue: asyncio.Queue = asyncio.Queue(QUEUE_EVENTS)
        self._task: asyncio.Task | None = None
        self._detached = self._closed = False
        self._error: BaseException | None = None

    async def body(self) -> AsyncIterator[bytes]:
        """The client's side: the events as the pump hands them over (those waiting, in one chunk)."""
        self._task = asyncio.create_task(self._pump(), name=f"stream {self._log.stream_id}")
        while True:
            item = await self._queue.get()
            batch, last = [], -1
            while item is not _EOF:
                last, data = item
                batch.append(data)
                if self._queue.empty():
                    break
                item = self._queue.get_nowait()
            if batch:
                await self._durable(last)
                yield b"".join(batch)
            if item is _EOF:
                break
        if self._error is not None:
            raise self._error

    async def _durable(self, seq: int) -> None:
        """A carried stream's events go out once its log holds them (within WRITE_AHEAD_S; past it the
        stream is no longer carried, and they go out)."""
        stream = self._log
        deadline = asyncio.get_running_loop().time() + WRITE_AHEAD_S
        while stream.source is not None:
            stream.wake.clear()
            if stream.flushed > seq:
                return
            try:
                async with asyncio.timeout_at(deadline):
                    await stream.wake.wait()
            except TimeoutError:
                log.warning("stream %s: its log is late; it can no longer be carried on", stream.stream_id)
                stream.source, stream.carry = None, b""

    async def _pump(self) -> None:
        whole = False
        try:
            async for data in self._inner:
                seq = self._logs.append(self._log, data)
                if self._log.taken:  # another gateway carries it on (this one was thought lost)
                    _hand_over(self._source)
                    break
                if not self._detached:
                    await self._queue.put((seq, framed(self._prefix + str(seq).encode(), data)))
            whole = not self._log.taken
        except Exception as exc:  # handed to the client's side, which raises it as the body would have
            self._error = exc
        finally:
            self._logs.end(self._log, whole=whole)
            closer = getattr(self._inner, "aclose", None)
            if closer is not None:  # its own clean-up (`finally` blocks) runs now, however the pump ended
                with contextlib.suppress(Exception):
                    await closer()
            if self._detached:
                await self._close_once()
        if not self._detached:
            await self._queue.put(_EOF)

    async def close(self) -> None:
        """The response's clean-up: the stream's own at once when it has ended; else the stream runs on
        detached (its events still logged) until it ends or the grace window passes, and cleans up then."""
        if self._task is None or self._task.done() or stalled_cut() or self._grace_s <= 0 or self._draining():
            # nor a client that stops reading, nor a drain
            if self._task is not None and not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task})
            await self._close_once()
            return
        self._detached = True
        while not self._queue.empty():  # a pump waiting to hand over an event goes on
            self._queue.get_nowait()
        handle = asyncio.get_running_loop().call_later(self._grace_s, self._task.cancel)
        self._task.add_done_callback(lambda _: handle.cancel())
        self._logs.detached(self._task)
        log.info("client left stream %s; it runs on for up to %gs for a reconnect", self._log.stream_id,
                 self._grace_s)

    async def _close_once(self) -> None:
        if not self._closed:
            self._closed = True
            await self._on_close()


def _hand_over(source: TokenSource | None) -> None:
    """The new owner settles the stream: its generation here charges nothing when it closes."""
    hand_over = getattr(source, "hand_over", None)
    if hand_over is not None:
        hand_over()
