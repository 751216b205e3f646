"""Asyncio client for one worker: a DEALER socket whose receive task demultiplexes `out`/`err`/`stats`
frames into per-request streams of `OutItem`s, with a deadline on every wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from enum import StrEnum
from typing import Any

import zmq
import zmq.asyncio

from worker.protocol import (
    PROTOCOL_VERSION,
    ErrFrame,
    ErrorCode,
    OutFrame,
    OutItem,
    Priority,
    ProtocolError,
    SamplingParams,
    WorkerStats,
    decode_worker_frame,
    encode_abort,
    encode_gen,
    encode_hello,
)

log = logging.getLogger(__name__)

class LinkError(StrEnum):
    """Codes of errors raised by this client rather than sent by the worker."""

    TIMEOUT = "timeout"  # no tokens (or no first stats) within the deadline
    WORKER_LOST = "worker_lost"  # no stats for worker_timeout
    INCOMPATIBLE = "incompatible"  # the worker speaks another protocol version
    CLOSED = "closed"  # this client was closed


class WorkerError(Exception):
    """A request ended with an error from the worker (`ErrorCode`) or from the link to it (`LinkError`)."""

    def __init__(self, code: ErrorCode | LinkError, message: str, retryable: bool) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class WorkerClient:
    def __init__(self, endpoint: str, *, gateway_id: str, context: zmq.asyncio.Context | None = None,
                 inter_token_timeout: float = 30.0, worker_timeout: float = 1.0,
                 heartbeat_interval: float = 1.0,
                 on_stats: Callable[[WorkerClient, WorkerStats], None] | None = None) -> None:
        self.endpoint = endpoint
        self.gateway_id = gateway_id
        self.inter_token_timeout = inter_token_timeout
        self.worker_timeout = worker_timeout
        self.heartbeat_interval = heartbeat_interval
        self.on_stats = on_stats
        self.stats: WorkerStats | None = None  # latest; .received_at is time.monotonic()
        self.incompatible: str | None = None  # reason, once a stats frame showed another protocol version
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._streams: dict[str, asyncio.Queue[OutItem | WorkerError]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = asyncio.Event()
        self._closed = False
        self._lost_reported = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.gateway_id.encode())
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.connect(self.endpoint)
        self._sock = sock
        self._send_soon(encode_hello(self.gateway_id))
        self._tasks = [asyncio.create_task(self._recv_loop(), name=f"sy-client-recv-{self.endpoint}"),
                       asyncio.create_task(self._heartbeat_loop(), name=f"sy-client-hb-{self.endpoint}")]

    async def wait_ready(self, timeout: float) -> WorkerStats:
        """Wait for the worker's first stats frame; raises WorkerError("timeout") after `timeout` s."""
        try:
            async with asyncio.timeout(timeout):
                await self._ready.wait()
        except TimeoutError:
            raise WorkerError(LinkError.TIMEOUT, f"no stats from {self.endpoint} within {timeout}s", True) from None
        if self.incompatible:
            raise WorkerError(LinkError.INCOMPATIBLE, self.incompatible, False)
        assert self.stats is not None
        return self.stats

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(WorkerError(LinkError.CLOSED, "worker client closed", True))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._sock is not None:
            self._sock.close()

    @property
    def alive(self) -> bool:
        """Stats arrived within worker_timeout (the worker may still be incompatible: see `usable`)."""
        return self.stats is not None and time.monotonic() - self.stats.received_at <= self.worker_timeout

    @property
    def usable(self) -> bool:
        """Alive, same protocol version and not draining: the router may send it new requests."""
        return self.alive and not self.incompatible and self.stats is not None and not self.stats.draining

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------ requests

    async def generate(self, rid: str, ns: bytes, tokens: Any, sampling: SamplingParams,
                       priority: Priority = Priority.INTERACTIVE, deadline: float = 0.0) -> AsyncIterator[OutItem]:
        """Stream a request's tokens (the `gen` goes out on the first iteration).

        Raises WorkerError; leaving the iterator early sends `abort` to the worker.
        """
        if self._closed or self._sock is None:
            raise WorkerError(LinkError.CLOSED, "worker client is not running", True)
        if self.incompatible:
            raise WorkerError(LinkError.INCOMPATIBLE, self.incompatible, False)
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} already has an open stream")
        queue: asyncio.Queue[OutItem | WorkerError] = asyncio.Queue()
        self._streams[rid] = queue
        ended = False
        try:
            self._send_soon(encode_gen(rid, ns, tokens, sampling, priority, deadline))
            while True:
                if queue.empty():
                    try:
                        async with asyncio.timeout(self.inter_token_timeout):
                            item = await queue.get()
                    except TimeoutError:
                        raise WorkerError(LinkError.TIMEOUT, f"no tokens for {self.inter_token_timeout}s", True) from None
                else:
                    item = queue.get_nowait()
                if isinstance(item, WorkerError):
                    # worker-side errors end the request there; link errors may not have
                    ended = isinstance(item.code, ErrorCode)
                    raise item
                ended = item.finish_reason is not None
                yield item
                if ended:
                    return
        finally:
            self._streams.pop(rid, None)
            if not ended and not self._closed:
                self._send_soon(encode_abort(rid))

    async def abort(self, rid: str) -> None:
        """Ask the worker to stop `rid`; its stream (if open) ends with finish_reason "abort"."""
        if self._sock is not None and not self._closed:
            await self._sock.send(encode_abort(rid))

    # ------------------------------------------------------------ internals

    def _send_soon(self, payload: bytes) -> None:
        assert self._sock is not None
        fut = self._sock.send(payload)
        fut.add_done_callback(_consume_exception)

    async def _heartbeat_loop(self) -> None:
        hello = encode_hello(self.gateway_id)
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._send_soon(hello)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        poll_s = max(0.05, min(self.worker_timeout, self.heartbeat_interval) / 2)
        while True:
            if await self._sock.poll(timeout=int(poll_s * 1000)):
                self._dispatch(await self._sock.recv())
            elif self._streams and self.stats is not None and not self.alive and not self._lost_reported:
                self._lost_reported = True  # once per outage; the next stats frame re-arms it
                self._fail_all(WorkerError(LinkError.WORKER_LOST, f"no stats from {self.endpoint} "
                                           f"for {self.worker_timeout}s", True))

    def _dispatch(self, data: bytes) -> None:
        try:
            frame = decode_worker_frame(data)
        except ProtocolError as exc:
            log.warning("dropping malformed frame from worker %s: %s", self.endpoint, exc)
            return
        if isinstance(frame, OutFrame):
            streams = self._streams
            for item in frame.items:
                queue = streams.get(item.rid)
                if queue is not None:
                    queue.put_nowait(item)
        elif isinstance(frame, ErrFrame):
            queue = self._streams.get(frame.rid)
            if queue is not None:
                queue.put_nowait(WorkerError(frame.code, frame.message, frame.retryable))
        else:
            self._on_stats(frame)

    def _on_stats(self, stats: WorkerStats) -> None:
        stats.received_at = time.monotonic()
        if stats.version != PROTOCOL_VERSION:
            if not self.incompatible:
                self.incompatible = (f"worker {stats.worker_id} speaks protocol version {stats.version}, "
                                     f"this gateway speaks {PROTOCOL_VERSION}")
                log.error("%s; refusing it", self.incompatible)
                self._fail_all(WorkerError(LinkError.INCOMPATIBLE, self.incompatible, False))
        self.stats = stats
        self._lost_reported = False
        self._ready.set()
        if self.on_stats is not None:
            try:
                self.on_stats(self, stats)
            except Exception:
                log.exception("on_stats callback failed")

    def _fail_all(self, error: WorkerError) -> None:
        for queue in self._streams.values():
            queue.put_nowait(error)


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("send to worker failed: %s", fut.exception())
