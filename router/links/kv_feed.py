"""The router's subscriptions to vLLM-format KV events: per source a SUB socket on its PUB endpoint and a
DEALER on its replay endpoint; a gap in the numbers asks for a replay (answered within REPLAY_TIMEOUT_S or
given up), live batches that arrive meanwhile are dropped and fetched by the next replay.

Nothing here blocks: `step()` reads what is queued, `run()` calls it every POLL_S inside the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq

from router.links.kv_ingest import FeedSource, KvIngest, Outcome
from router.placement.kv_index import KvIndex
from worker.protocol.vllm_events import MAX_PAYLOAD_BYTES, REPLAY_END, decode_seq, encode_seq

log = logging.getLogger(__name__)

POLL_S = 0.02
REPLAY_TIMEOUT_S = 2.0
MAX_MESSAGES_PER_STEP = 1_000  # per source and step: one busy source cannot hold the loop


class KvFeed:
    """One source: its sockets, its replay in flight and its ingest."""

    def __init__(self, ctx: zmq.Context, source: FeedSource, index: KvIndex, block_size: int,
                 cluster_key: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.ingest = KvIngest(source, index, block_size)
        self._ctx = ctx
        self._key = cluster_key
        self._clock = clock
        self._replay_from: int | None = None  # the start asked for, while a replay is in flight
        self._replay_until = 0.0
        self._first_replayed = True
        self._resync_next = False  # a replay failed: take the next live batch as a fresh start
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        self.sub.connect(source.endpoint)
        self.dealer: zmq.Socket | None = None

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        if self._key:  # the publisher is the CURVE server under the cluster key pair
            secret = self._key.encode()
            sock.curve_secretkey = secret
            sock.curve_publickey = sock.curve_serverkey = zmq.curve_public(secret)
        return sock

    @property
    def replaying(self) -> bool:
        return self._replay_from is not None

    def step(self) -> int:
        """Take in what is queued on both sockets; returns the messages read."""
        n = 0
        if self.dealer is not None and self.replaying:
            n += self._read_replay()
            if self.replaying and self._clock() > self._replay_until:
                self._give_up_replay(f"no answer within {REPLAY_TIMEOUT_S} s")
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                parts = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            self._live(parts)
        return n

    def close(self) -> None:
        self.sub.close(0)
        if self.dealer is not None:
            self.dealer.close(0)

    # ------------------------------------------------------------ internals

    def _live(self, parts: list[bytes]) -> None:
        if len(parts) != 3:
            self.ingest.counts["bad_message"] += 1
            log.warning("kv events from %s: message of %d frames dropped (want topic, seq, payload)",
                        self.source.worker_id, len(parts))
            return
        try:
            seq = decode_seq(parts[1])
        except ValueError as exc:
            self.ingest.counts["bad_message"] += 1
            log.warning("kv events from %s: %s", self.source.worker_id, exc)
            return
        if self.replaying:
            self.ingest.counts["dropped_while_replaying"] += 1  # the next replay fetches it
            return
        if self._resync_next:
            self._resync_next = False
            self.ingest.resync_at(seq)
        if self.ingest.offer(seq, parts[2]) is Outcome.GAP:
            self._ask_replay(seq, parts[2])

    def _ask_replay(self, seq: int, payload: bytes) -> None:
        start = self.ingest.next_seq or 0
        if not self.source.replay_endpoint:
            self.ingest.resync_at(seq)  # nothing to ask: start over from this batch
            self.ingest.offer(seq, payload)
            return
        if self.dealer is None:
            self.dealer = self._socket(zmq.DEALER)
            self.dealer.connect(self.source.replay_endpoint)
        try:
            self.dealer.send_multipart([b"", encode_seq(start)], zmq.NOBLOCK)
        except zmq.Again:
            self._give_up_replay("replay socket not ready")
            return
        self._replay_from, self._first_replayed = start, True
        self._replay_until = self._clock() + REPLAY_TIMEOUT_S
        self.ingest.counts["replay"] += 1

    def _read_replay(self) -> int:
        assert self.dealer is not None
        n = 0
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                parts = self.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            if len(parts) != 3 or len(parts[1]) != len(REPLAY_END):
                self.ingest.counts["bad_message"] += 1
                continue
            if parts[1] == REPLAY_END:
                self._replay_from = None
                break
            self._replayed(decode_seq(parts[1]), parts[2])
        return n

    def _replayed(self, seq: int, payload: bytes) -> None:
        if self._first_replayed:
            self._first_replayed = False
            expected = self.ingest.next_seq or 0
            if seq > expected:  # the publisher's buffer no longer holds them
                log.warning("kv events from %s: batches %d..%d left the replay buffer: view resynced",
                            self.source.worker_id, expected, seq - 1)
                self.ingest.resync_at(seq)
        self.ingest.offer(seq, payload, replayed=True)

    def _give_up_replay(self, why: str) -> None:
        log.warning("kv events from %s: replay failed (%s): the view starts over at the next batch",
                    self.source.worker_id, why)
        self.ingest.counts["replay_failed"] += 1
        self._replay_from = None
        if self.dealer is not None:  # a late answer must not be read as the next one's
            self.dealer.close(0)
            self.dealer = None
        self.ingest.restart()
        self._resync_next = True


class KvFeeds:
    """Every configured source, stepped from the event loop until `close()`."""

    def __init__(self, sources: list[FeedSource], index: KvIndex, block_size: int,
                 cluster_key: str | None = None) -> None:
        self._ctx = zmq.Context()
        self.feeds = [KvFeed(self._ctx, s, index, block_size, cluster_key) for s in sources]
        self._closed = False

    def step(self) -> int:
        return sum(feed.step() for feed in self.feeds)

    async def run(self) -> None:
        while not self._closed:
            try:
                self.step()
            except Exception:  # a feed must never take the router down
                log.exception("kv events: feed step failed")
            await asyncio.sleep(POLL_S)

    def close(self) -> None:
        self._closed = True
        for feed in self.feeds:
            feed.close()
        self._ctx.term()
