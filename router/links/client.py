"""Asyncio client for one worker: a DEALER socket whose receive task demultiplexes `out`/`err`/`stats`
frames into per-request streams of `OutItem`s, with a deadline on every wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from enum import StrEnum
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.priorities import Priority
from worker.protocol import (
    PROTOCOL_VERSION,
    ErrFrame,
    ErrorCode,
    OutFrame,
    OutItem,
    PrefillHint,
    ProtocolError,
    SamplingParams,
    WorkerStats,
    decode_worker_frame,
    encode_abort,
    encode_gen,
    encode_hello,
    encode_sync,
    rids_in_frame,
)

log = logging.getLogger(__name__)

MAX_WORKER_FRAME_BYTES = 64 << 20  # outs, errs and stats (a stats frame's two id lists: 32 MB at most)
MAX_FRAMES_PER_DRAIN = 1024  # frames taken in one go before the receive task yields to the loop
HEARTBEAT_IVL_S = 0.25  # ZMTP pings on the link, answered by the worker's ZeroMQ I/O thread (not its loop)
LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class LinkError(StrEnum):
    """Codes of errors raised by this client rather than sent by the worker."""

    TIMEOUT = "timeout"  # no tokens (or no first stats) within the deadline
    WORKER_LOST = "worker_lost"  # no stats for worker_timeout (link down) or stall_timeout (link up)
    INCOMPATIBLE = "incompatible"  # the worker speaks another protocol version
    CLOSED = "closed"  # this client was closed
    PROTOCOL = "protocol"  # the worker sent a frame about this request that could not be decoded


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
                 heartbeat_interval: float = 1.0, cluster_key: str | None = None,
                 on_stats: Callable[[WorkerClient, WorkerStats], None] | None = None,
                 stall_timeout: float = 10.0) -> None:
        self.endpoint = endpoint
        self.gateway_id = gateway_id
        self.inter_token_timeout = inter_token_timeout
        self.worker_timeout = worker_timeout  # stats silence that means loss while the link is down
        self.stall_timeout = stall_timeout  # ... while the link still answers ZMTP pings (a busy worker loop)
        self.heartbeat_interval = heartbeat_interval
        self.on_stats = on_stats
        self.stats: WorkerStats | None = None  # latest; .received_at is time.monotonic()
        self.incompatible: str | None = None  # reason, once a stats frame showed another protocol version
        self._cluster_key = cluster_key  # z85 CURVE secret key of the cluster; None: plain TCP (dev only)
        self._heard_at: float | None = None  # time.monotonic() of the last frame received
        self._quiet_at = 0.0  # time.monotonic() when the socket was last seen empty, after draining it
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        # up: stats arrived over a connection that has not dropped (or missed its pings) since; a worker
        # restarted on the same endpoint is down until its first stats, so it counts as back from the dead
        self.link_up = False
        self._connected = False
        # closed: the connection dropped and no handshake has succeeded since (a dead process, a lost host)
        self.link_closed = False
        self._streams: dict[str, asyncio.Queue[OutItem | WorkerError]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = asyncio.Event()
        self._closed = False
        self._lost_rids: set[str] = set()  # streams told of this outage (one error each; stats clear it)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_WORKER_FRAME_BYTES)  # a larger frame drops the link
        # An unguessable routing id: no other peer can take over this link's identity and its streams.
        sock.setsockopt(zmq.IDENTITY, f"{self.gateway_id[:64]}/{secrets.token_hex(16)}".encode())
        if self._cluster_key is not None:
            sock.curve_secretkey = self._cluster_key.encode()
            sock.curve_publickey = sock.curve_serverkey = zmq.curve_public(self._cluster_key.encode())
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # a worker whose process stops answering (frozen, host gone) is disconnected after worker_timeout
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(1000 * min(HEARTBEAT_IVL_S, self.worker_timeout / 2)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(1000 * self.worker_timeout))
        self._monitor = sock.get_monitor_socket(LINK_EVENTS)
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
            raise WorkerError(LinkError.TIMEOUT, f"no stats from {self.endpoint} within {timeout}s",
                              True) from None
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
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
            self._sock.close()

    def silent_for(self) -> float:
        """Seconds the link has been observed silent: from the last frame received to the last time the
        receive task found the socket empty. A stall of this process's event loop does not count (frames
        wait in the socket meanwhile); infinite before the first frame."""
        if self._heard_at is None:
            return float("inf")
        return max(0.0, self._quiet_at - self._heard_at)

    @property
    def silence_limit(self) -> float:
        """How long stats may be missing before the worker counts as lost: worker_timeout once the link is
        down (a dead process closes it at once, a frozen one stops answering pings), stall_timeout while
        the worker's ZeroMQ I/O thread still answers (its loop is busy, not dead)."""
        return max(self.stall_timeout, self.worker_timeout) if self.link_up else self.worker_timeout

    @property
    def alive(self) -> bool:
        """Stats arrived, the connection has not dropped since, and the link has not been silent past
        `silence_limit` (see `usable` for the version)."""
        return self.stats is not None and not self.link_closed and self.silent_for() <= self.silence_limit

    @property
    def usable(self) -> bool:
        """Alive, same protocol version and not draining: the router may send it new requests."""
        return self.alive and not self.incompatible and self.stats is not None and not self.stats.draining

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------ requests

    async def generate(self, rid: str, ns: bytes, tokens: Any, sampling: SamplingParams,
                       priority: Priority = Priority.INTERACTIVE, deadline: float = 0.0, *, fkey: bytes = b"",
                       weight: float = 1.0, resumed: int = 0, traceparent: str = "",
                       prefill: PrefillHint | None = None, ttft_deadline: float = 0.0,
                       ) -> AsyncIterator[OutItem]:
        """Stream a request's tokens (the `gen` goes out on the first iteration). `prefill`: the worker
        receives the prompt's pages from that prefill worker instead of computing them (disaggregated
        prefill).

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
        # Before the first item the request may wait its turn in the worker's queue: that wait is bounded by
        # the request's deadline (a live worker's queue is not a stall; a dead or frozen one is lost by its
        # stats)
        wait = (max(self.inter_token_timeout, deadline - time.time()) if deadline > 0
                else self.inter_token_timeout)
        try:
            self._send_soon(encode_gen(rid, ns, tokens, sampling, priority, deadline, fkey, weight, resumed,
                                       traceparent, prefill, ttft_deadline))
            while True:
                if queue.empty():
                    try:
                        async with asyncio.timeout(wait):
                            item = await queue.get()
                    except TimeoutError:
                        raise WorkerError(LinkError.TIMEOUT, f"no tokens for {wait:.0f}s", True) from None
                else:
                    item = queue.get_nowait()
                wait = self.inter_token_timeout
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
            self._lost_rids.discard(rid)
            if not ended and not self._closed:
                self._send_soon(encode_abort(rid))

    async def abort(self, rid: str) -> None:
        """Ask the worker to stop `rid`; its stream (if open) ends with finish_reason "abort"."""
        if self._sock is not None and not self._closed:
            await self._sock.send(encode_abort(rid))

    def request_sync(self) -> None:
        """Ask the worker for a snapshot of the blocks it holds (it comes on the stats stream)."""
        if self._sock is not None and not self._closed:
            self._send_soon(encode_sync())

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
        poll_ms = int(1000 * max(0.02, min(0.1, self.worker_timeout / 4, self.heartbeat_interval / 2)))
        while True:
            await self._sock.poll(timeout=poll_ms)
            await self._link_events()
            if await self._drain():
                self._quiet_at = time.monotonic()
            if self.stats is not None and not self.alive and len(self._lost_rids) < len(self._streams):
                # every stream of this outage, also one opened after it was first reported (the router
                # picked this worker just before its link dropped): none waits for its deadline
                link = "up" if self.link_up else "down"
                self._fail_lost(WorkerError(LinkError.WORKER_LOST, f"no stats from {self.endpoint} "
                                            f"for {self.silence_limit}s (link {link})", True))

    async def _link_events(self) -> None:
        """Follow the link's state from the socket monitor (handshakes up, disconnects down)."""
        if self._monitor is None:
            return
        while True:
            try:
                raw = await self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._connected = parse_monitor_message(raw)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            self.link_closed = not self._connected
            if not self._connected:
                self.link_up = False
                for _ in range(8):  # frames that came before the drop reach their streams first
                    if await self._drain():
                        break
                self._link_lost()

    def _link_lost(self) -> None:
        """The connection dropped: the open streams end now (worker_lost, so they resume elsewhere) rather
        than after worker_timeout of silence. Output sent meanwhile is gone with the connection either way."""
        lost = WorkerError(LinkError.WORKER_LOST, f"link to {self.endpoint} closed (link down)", True)
        self._fail_lost(lost)

    async def _drain(self) -> bool:
        """Take every waiting frame, up to MAX_FRAMES_PER_DRAIN; True when the socket was left empty."""
        assert self._sock is not None
        for _ in range(MAX_FRAMES_PER_DRAIN):
            try:
                data = await self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                self._dispatch(data)
            except Exception:  # one bad frame must not end the link's receive task
                log.exception("error handling a frame from worker %s", self.endpoint)
            finally:  # after dispatch: a stats listener still sees how long the link had been silent
                self._heard_at = time.monotonic()
        return False

    def _dispatch(self, data: bytes) -> None:
        try:
            frame = decode_worker_frame(data)
        except ProtocolError as exc:
            self._malformed(data, exc)
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
        self._lost_rids.clear()
        self._ready.set()
        if self.on_stats is not None:
            try:
                self.on_stats(self, stats)
            except Exception:
                log.exception("on_stats callback failed")
        self.link_up = self._connected  # after the listener: it judged the silence this frame ended

    def _malformed(self, data: bytes, exc: ProtocolError) -> None:
        """End the requests a bad frame names (their output is lost) with a retryable error; log the rest."""
        rids = [rid for rid in rids_in_frame(data) if rid in self._streams]
        log.warning("malformed frame from worker %s (%s); ending %d request(s)", self.endpoint, exc.message,
                    len(rids))
        error = WorkerError(LinkError.PROTOCOL, f"malformed frame from the worker: {exc.message}", True)
        for rid in rids:
            self._streams[rid].put_nowait(error)

    def _fail_all(self, error: WorkerError) -> None:
        for queue in self._streams.values():
            queue.put_nowait(error)

    def _fail_lost(self, error: WorkerError) -> None:
        """End with `error` every open stream not yet told of this outage."""
        for rid, queue in self._streams.items():
            if rid not in self._lost_rids:
                self._lost_rids.add(rid)
                queue.put_nowait(error)


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("send to worker failed: %s", fut.exception())
