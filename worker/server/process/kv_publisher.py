"""The worker's radix-cache batches published as vLLM KV events (worker.protocol.vllm_events): a PUB socket,
a ROUTER replay socket and a bounded buffer of past batches, served by one thread; opt-in
(`--kv-events-endpoint`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from worker.kvcache.events import KvBatch, KvEvents
from worker.protocol.vllm_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KVEventBatch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from worker.server.process.link_auth import LinkAuth
from worker.server.process.server_config import ServerConfig

if TYPE_CHECKING:
    from worker.engine.core import Engine

log = logging.getLogger(__name__)

DEFAULT_BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default)
DEFAULT_MAX_QUEUE = 1_000  # batches waiting for the thread; past it they are dropped and a snapshot follows
POLL_S = 0.05


@dataclass(slots=True)
class PublisherConfig:
    endpoint: str  # PUB: bound when it holds "*", "::", ipc:// or inproc:// (vLLM's rule), else connected
    replay_endpoint: str | None = None  # ROUTER, bound; None: no replay
    topic: str = ""
    block_size: int = 16
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    max_queue: int = DEFAULT_MAX_QUEUE
    data_parallel_rank: int = 0


def to_events(batch: KvBatch, block_size: int) -> list[KvEvent]:
    """One KvBatch as vLLM events: ids as block hashes, no parent or tokens (Switchyard's batches are sets
    of ids, not chains); memory is "GPU", the tiers below it "CPU"; snapshots open with AllBlocksCleared."""
    events: list[KvEvent] = [AllBlocksCleared()] if batch.snapshot else []
    if batch.stored:
        events.append(BlockStored(list(batch.stored), None, [], block_size, None, MEDIUM_GPU))
    if batch.evicted:
        events.append(BlockRemoved(list(batch.evicted), MEDIUM_GPU))
    if batch.tiered:
        events.append(BlockStored(list(batch.tiered), None, [], block_size, None, MEDIUM_CPU))
    if batch.untiered:
        events.append(BlockRemoved(list(batch.untiered), MEDIUM_CPU))
    return events


class KvEventPublisher:
    """`offer` is called from the worker loop with each batch (or None when nothing changed); the thread
    numbers, sends and buffers them and answers replay requests."""

    def __init__(self, ctx: zmq.Context, cfg: PublisherConfig,
                 secure: Callable[[zmq.Socket], None] | None = None) -> None:
        self.cfg = cfg
        self.dropped = 0  # batches the queue had no room for (each followed by a snapshot)
        self.replay_misses = 0  # replay requests older than the buffer (each followed by a snapshot)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=cfg.max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._need_snapshot = threading.Event()
        self._seq = 0
        self._topic = cfg.topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.replay = ctx.socket(zmq.ROUTER) if cfg.replay_endpoint else None
        for sock in (self.pub, self.replay):
            if sock is not None:
                if secure is not None:
                    secure(sock)
                sock.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        ep = cfg.endpoint
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            self.pub.bind(ep)
        else:
            self.pub.connect(ep)
        if self.replay is not None:
            self.replay.setsockopt(zmq.MAXMSGSIZE, 64)
            self.replay.bind(cfg.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def endpoints(self) -> tuple[str, str | None]:
        """The bound (or connected) endpoints, with ephemeral ports resolved."""
        pub = self.pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.cfg.endpoint
        rep = self.replay.getsockopt_string(zmq.LAST_ENDPOINT) if self.replay is not None else None
        return pub, rep

    def offer(self, batch: KvBatch | None, snapshot: Callable[[], KvBatch]) -> None:
        """Queue `batch` (None: no change); when a batch was lost or a subscriber asked for more than the
        buffer holds, `snapshot()` instead (it includes every pending change)."""
        if self._need_snapshot.is_set():
            self._need_snapshot.clear()
            batch = snapshot()
        if batch is None:
            return
        events = to_events(batch, self.cfg.block_size)
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), events, self.cfg.data_parallel_rank))
        except queue.Full:
            self.dropped += 1
            self._need_snapshot.set()
            log.warning("kv events: publisher queue full (%d batches): batch dropped, a snapshot follows",
                        self.cfg.max_queue)

    def close(self, timeout_s: float = 1.0) -> None:
        self._running = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while self._running:
            if self.replay is not None and self.replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    log.exception("kv events: replay request failed")
            try:
                batch = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                break
            try:
                self._send(batch)
            except Exception:
                log.exception("kv events: sending batch %d failed", self._seq)

    def _send(self, batch: KVEventBatch) -> None:
        seq, payload = self._seq, encode_batch(batch)
        self._seq += 1
        self._buffer.append((seq, payload))
        self.pub.send_multipart((self._topic, encode_seq(seq), payload))

    def _serve_replay(self) -> None:
        assert self.replay is not None
        frames = self.replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3:
            log.warning("kv events: dropping a replay request of %d frames (want identity, empty, seq)",
                        len(frames))
            return
        ident, _, raw = frames
        try:
            start = decode_seq(raw)
        except ValueError as exc:
            log.warning("kv events: dropping a replay request: %s", exc)
            return
        oldest = self._buffer[0][0] if self._buffer else self._seq
        if start < oldest:  # the buffer no longer holds all it asks for: everything follows as a snapshot
            self.replay_misses += 1
            self._need_snapshot.set()
        for seq, payload in list(self._buffer):
            if seq >= start:
                self.replay.send_multipart((ident, b"", encode_seq(seq), payload), zmq.NOBLOCK)
        self.replay.send_multipart((ident, b"", REPLAY_END, b""), zmq.NOBLOCK)


def start_publisher(ctx: zmq.Context, cfg: PublisherConfig, events: KvEvents,
                    secure: Callable[[zmq.Socket], None] | None) -> KvEventPublisher:
    """A publisher fed by `events` (the radix cache's KvEvents: `kv_report` offers it each batch)."""
    pub = KvEventPublisher(ctx, cfg, secure)
    events.on_batch = pub.offer
    log.info("kv events: publishing vLLM KV event batches on %s (replay %s, topic %r)", *pub.endpoints(),
             cfg.topic)
    return pub


def server_publisher(ctx: zmq.Context, config: ServerConfig, engine: Engine, worker_id: str,
                     auth: LinkAuth | None) -> KvEventPublisher | None:
    """The worker's publisher when `config.kv_events_endpoint` is set (None otherwise). CurveZMQ under the
    cluster key as on the worker port, unless `kv_events_plain` (subscribers that cannot present a key, such
    as llm-d's); without a key, or plain, only a loopback endpoint unless plain is set on purpose."""
    endpoint = config.kv_events_endpoint
    if not endpoint:
        return None
    if engine.cache is None:
        log.warning("kv events: %s ignored: no prefix cache on this worker, so no blocks to report", endpoint)
        return None
    if not config.kv_events_plain:
        for ep in (endpoint, config.kv_events_replay):
            if ep:
                LinkAuth.check(config.cluster_key, ep)
    topic = config.kv_events_topic
    if topic is None:
        topic = f"kv@{worker_id}@{engine.model_id}"
    cfg = PublisherConfig(endpoint, config.kv_events_replay, topic, engine.config.block_size)
    secure = None if config.kv_events_plain or auth is None else auth.secure
    return start_publisher(ctx, cfg, engine.cache.events, secure)
