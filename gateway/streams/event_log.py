"""Each stream's event log: a Redis stream per SSE stream, under its tenant's hash tag, bounded and expiring.

Writes are batched: events wait in memory and one flusher task sends every open stream's new events in one
pipeline each FLUSH_S, one entry per stream and flush (its events joined; entry id = its last event's), so no
token costs a Redis command. A `live` key, refreshed by the flusher while the stream's gateway still carries
it, tells a reader on another gateway whether more events can come.

A stream that can be carried on by another gateway (`gateway.streams.carry_on`) also logs, with each entry,
the token ids its events were made from and, once, the record of its request (`carry_key`); its events reach
the client only once they are in Redis (`flushed`), so a client never holds an event the log lacks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gateway.telemetry import gateway_metrics
from tenancy import tag

log = logging.getLogger("switchyard.gateway")

FLUSH_S = 0.02  # events reach Redis within this (plus one round trip)
LIVE_TTL_S = 3.0  # a stream whose gateway wrote nothing and refreshed nothing for this long is lost
LIVE_REFRESH_S = 1.0
ALIVE_TTL_S = 0.5  # a gateway that has not said it is alive for this long is lost (its streams with it)
ALIVE_REFRESH_S = 0.1
TTL_S = 600  # a log expires this long after its last write
MAX_ENTRIES = 8192  # flushes kept per stream (a stream of up to 8,192 events stays whole): older ones go
MAX_READERS = 1024  # reconnected streams one gateway serves at once (503 past it)
MAX_PENDING = 65_536  # events waiting for a flush, all streams together; past it new events are not logged
FIRST = b"s"  # an entry's fields: the sequence number of its first event, and its events joined (`DATA`)
DATA = b"d"
END = b"end"  # the field of the entry that closes a log: "done" (it ended) or "cut" (it stopped early)
TOKENS = b"t"  # a carried stream's entry: the token ids its events were made from (int32)
CODES = b"n"  # ... and per event, new tokens * 4 + finish (0 none, 1 stop, 2 length) (int32)
CHOICES = b"c"  # a carried group of choices: CODES per step (a delta it framed), and each step's choice
CACHED = b"k"  # ... and its cached prompt tokens so far
FINISH_CODES = {None: 0, "stop": 1, "length": 2}


def log_key(tenant: str, stream_id: str) -> str:
    return tag(tenant) + f":sse:{stream_id}"


RUNS_KEY = "sy:background-runs"  # zset: "<tenant> <response id>" of logged background runs, by deadline


class StreamTaken(Exception):
    """Another gateway carries this stream on now: this one stops it, and records nothing of its end."""


def run_member(tenant: str, response_id: str) -> str:
    return f"{tenant} {response_id}"


def alive_key(owner_id: bytes) -> str:
    """Refreshed by a gateway while it carries streams; a stream's `live` key names its gateway's id."""
    return "sy:gateway-alive:" + owner_id.decode()


def live_key(tenant: str, stream_id: str) -> str:
    return tag(tenant) + f":sse:{stream_id}:live"


async def gateway_lost(redis: Any, tenant: str, stream_id: str) -> bool:
    """No gateway carries the stream: no `live` key, or the gateway it names is no longer alive."""
    owner = await redis.get(live_key(tenant, stream_id))
    return owner is None or not await redis.exists(alive_key(owner))


def carry_key(tenant: str, stream_id: str) -> str:
    return tag(tenant) + f":sse:{stream_id}:carry"


def owner_key(tenant: str, stream_id: str) -> str:
    """Set (NX) by the gateway that carries a lost stream on; its first gateway stops when it sees it."""
    return tag(tenant) + f":sse:{stream_id}:owner"


class TokenSource(Protocol):
    """What a carried stream's events are made from (`gateway.flow.generation.Generation`; a
    `gateway.flow.choices.GenerationGroup` also has `take_steps`)."""

    token_ids: list[int]
    finish_reason: str | None


def entry_id(seq: int) -> str:
    """The Redis stream entry id of event `seq` (0, 1, ...): `0-<seq + 1>` (ids must be above 0-0)."""
    return f"0-{seq + 1}"


def entry_seq(entry: bytes | str) -> int:
    text = entry.decode() if isinstance(entry, bytes) else entry
    return int(text.partition("-")[2]) - 1


@dataclass(slots=True)
class StreamLog:
    """One stream's log: `append` numbers and buffers an event; `end` closes the log."""

    tenant: str
    stream_id: str
    next_seq: int = 0
    pending: list[bytes] = field(default_factory=list)  # events next_seq - len(pending) ... next_seq - 1
    ended: bool = False
    dropped: bool = False  # the pending bound was hit: this log stays incomplete, and says so when it ends
    refreshed: float = 0.0  # time.monotonic() of the last `live` refresh (and expiry)
    whole: bool = False  # it ended with its last event (not cut)
    source: TokenSource | None = None  # set: the stream can be carried on (its tokens are logged)
    carry: bytes | None = None  # its request's record, written with the first flush
    tokens_logged: int = 0  # of source.token_ids
    finish_logged: bool = False
    pending_tokens: list[int] = field(default_factory=list)
    pending_codes: list[int] = field(default_factory=list)
    pending_choices: list[int] | None = None  # a group's: each pending step's choice
    cached: int = 0  # a group's cached prompt tokens so far
    flushed: int = 0  # events before this one are in Redis
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set by each flush
    taken: bool = False  # another gateway carries it on now: this one stops
    owned: bool = False  # this gateway carries it on (it holds `owner_key`)

    @property
    def key(self) -> str:
        return log_key(self.tenant, self.stream_id)


class EventLogs:
    """This gateway's open stream logs and their flusher."""

    def __init__(self, client: Any, *, flush_s: float = FLUSH_S, ttl_s: int = TTL_S,
                 max_entries: int = MAX_ENTRIES, max_pending: int = MAX_PENDING,
                 live_ttl_s: float = LIVE_TTL_S) -> None:
        self.redis = client
        self.flush_s, self.ttl_s, self.max_entries = flush_s, ttl_s, max_entries
        self.max_pending, self.live_ttl_s = max_pending, live_ttl_s
        self._open: dict[str, StreamLog] = {}
        self.owner_id = os.urandom(8).hex().encode()  # this gateway, as the owner of streams it carries on
        self._alive_at = 0.0  # time.monotonic() of the last `alive_key` refresh
        self._kick = asyncio.Event()  # wakes the flusher before its interval
        # replays being served (`gateway.streams.resume_routes`)
        self.readers, self.max_readers = 0, MAX_READERS
        self._pending = 0
        self._flusher: asyncio.Task | None = None
        self._detached: set[asyncio.Task] = set()  # streams whose client left, running on (`resumable`)

    def open(self, tenant: str, stream_id: str, *, source: TokenSource | None = None,
             carry: bytes | None = None, first_seq: int = 0, owned: bool = False) -> StreamLog:
        """A log to append to (`first_seq`, `owned`: a stream carried on here, after the events logged
        before)."""
        stream = StreamLog(tenant, stream_id, next_seq=first_seq, source=source, carry=carry,
                           flushed=first_seq, owned=owned)
        self._open[stream.key] = stream
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="event log flusher")
        return stream

    def append(self, stream: StreamLog, data: bytes) -> int:
        """Number one event and buffer it for the next flush; its sequence number."""
        seq = stream.next_seq
        stream.next_seq += 1
        if self._pending >= self.max_pending:
            if not stream.dropped:
                gateway_metrics.current().stream_log_dropped.inc()
                log.warning("event log: %d events wait for Redis; stream %s is no longer logged",
                            self._pending, stream.stream_id)
            stream.dropped = True
            if stream.source is not None:  # nor can it be carried on: its record goes with the next flush
                stream.source, stream.carry = None, b""
        elif not stream.dropped:
            stream.pending.append(data)
            self._pending += 1
            if stream.source is not None:
                self._log_tokens(stream, stream.source)
                if seq == 0:  # its client waits for it (write-ahead): no flush interval on the first token
                    self._kick.set()
        return seq

    def append_or_stop(self, stream: StreamLog, data: bytes) -> int:
        """`append`, then raise `StreamTaken` if another gateway carries the stream on now."""
        seq = self.append(stream, data)
        if stream.taken:
            raise StreamTaken(stream.stream_id)
        return seq

    @staticmethod
    def _log_tokens(stream: StreamLog, source: TokenSource) -> None:
        """The tokens consumed since the last event, and the finish once it appears, go with this event (a
        group's: the steps it framed since)."""
        take = getattr(source, "take_steps", None)
        if take is not None:
            tokens, codes, choices, stream.cached = take()
            stream.pending_tokens += tokens
            stream.pending_codes += codes
            stream.pending_choices = (stream.pending_choices or []) + choices
            return
        ids, done = source.token_ids, stream.tokens_logged
        stream.pending_tokens += ids[done:]
        stream.tokens_logged = len(ids)
        code = 0
        if source.finish_reason is not None and not stream.finish_logged:
            stream.finish_logged = True
            code = FINISH_CODES.get(source.finish_reason, 0)
        stream.pending_codes.append((len(ids) - done) * 4 + code)

    def end(self, stream: StreamLog, *, whole: bool) -> None:
        """Close the log: an end entry (`done`, or `cut` when the stream stopped early or events were
        dropped), at the sequence number after its last event's."""
        if not stream.ended:
            stream.ended, stream.whole = True, whole and not stream.dropped

    def detached(self, task: asyncio.Task) -> None:
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _flush_loop(self) -> None:
        while self._open:
            with contextlib.suppress(TimeoutError):  # a carried stream's first event flushes at once
                await asyncio.wait_for(self._kick.wait(), self.flush_s)
            self._kick.clear()
            await self.flush()

    async def flush(self) -> None:
        """Send every buffered event, refresh `live` keys and expiries, forget ended logs (one pipeline)."""
        now = time.monotonic()
        batch = [(s, s.pending, s.next_seq, s.ended) for s in self._open.values()
                 if s.pending or s.ended or s.carry is not None or now - s.refreshed >= LIVE_REFRESH_S]
        alive = bool(self._open) and now - self._alive_at >= ALIVE_REFRESH_S
        if not batch and not alive:
            return
        pipe = self.redis.pipeline(transaction=False)
        if alive:
            pipe.set(alive_key(self.owner_id), b"1", px=int(ALIVE_TTL_S * 1000))
        saved, owner_checks = [], []
        for s, chunk, next_seq, ended in batch:
            saved.append((s.pending_tokens, s.pending_codes, s.pending_choices))
            s.pending, s.pending_tokens, s.pending_codes = [], [], []  # later events: the next flush
            s.pending_choices = None if s.pending_choices is None else []
            self._queue_writes(pipe, s, chunk, next_seq, ended, saved[-1], now, owner_checks)
        try:
            results = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # Redis down: the events wait for the next tick, within the pending bound
            log.warning("event log: a flush failed: %s", type(exc).__name__)
            for (s, chunk, _, _), (tokens, codes, choices) in zip(batch, saved, strict=True):
                s.pending[:0], s.pending_tokens[:0], s.pending_codes[:0] = chunk, tokens, codes
                if choices is not None:
                    s.pending_choices = choices + (s.pending_choices or [])
            return
        # an entry a failed flush wrote is refused as "equal or smaller" when sent again: it is there
        refused = [r for r in results if isinstance(r, Exception) and "equal or smaller" not in str(r)]
        if refused:
            log.warning("event log: Redis refused %d writes: %s", len(refused), type(refused[0]).__name__)
        if alive:
            self._alive_at = now
        for index, s in owner_checks:
            if results[index] not in (None, self.owner_id) and not s.taken:
                s.taken = True
                log.warning("stream %s is carried on by another gateway; this one stops it", s.stream_id)
        for s, chunk, next_seq, ended in batch:
            self._pending -= len(chunk)
            s.carry = None
            s.flushed = next_seq
            s.wake.set()
            if now - s.refreshed >= LIVE_REFRESH_S:
                s.refreshed = now
            if ended:
                self._open.pop(s.key, None)

    def _queue_writes(self, pipe: Any, s: StreamLog, chunk: list[bytes], next_seq: int, ended: bool,
                      tokens: tuple[list[int], list[int], list[int] | None], now: float,
                      owner_checks: list) -> None:
        if s.taken:  # another gateway writes this log now
            return
        if s.carry:
            pipe.set(carry_key(s.tenant, s.stream_id), s.carry, ex=self.ttl_s)
        elif s.carry is not None:  # b"": it can no longer be carried on
            pipe.delete(carry_key(s.tenant, s.stream_id))
        if chunk:
            fields: dict[bytes, Any] = {FIRST: next_seq - len(chunk), DATA: b"".join(chunk)}
            if s.source is not None:
                fields[TOKENS] = np.asarray(tokens[0], dtype="<i4").tobytes()
                fields[CODES] = np.asarray(tokens[1], dtype="<i4").tobytes()
                if tokens[2] is not None:
                    fields[CHOICES] = np.asarray(tokens[2], dtype="<i4").tobytes()
                    fields[CACHED] = s.cached
            pipe.xadd(s.key, fields, id=entry_id(next_seq - 1), maxlen=self.max_entries, approximate=False)
        if ended:
            pipe.xadd(s.key, {END: b"done" if s.whole else b"cut"}, id=entry_id(next_seq),
                      maxlen=self.max_entries, approximate=False)
            pipe.expire(s.key, self.ttl_s)
            pipe.delete(live_key(s.tenant, s.stream_id), carry_key(s.tenant, s.stream_id),
                        owner_key(s.tenant, s.stream_id))
        elif now - s.refreshed >= LIVE_REFRESH_S:
            pipe.expire(s.key, self.ttl_s)
            pipe.set(live_key(s.tenant, s.stream_id), self.owner_id, px=int(self.live_ttl_s * 1000))
            if s.owned:
                pipe.set(owner_key(s.tenant, s.stream_id), self.owner_id, px=int(self.live_ttl_s * 1000))
            if s.source is not None:
                pipe.expire(carry_key(s.tenant, s.stream_id), self.ttl_s)
                owner_checks.append((len(pipe), s))
                pipe.get(owner_key(s.tenant, s.stream_id))

    async def close(self) -> None:
        """Streams whose client left end (cut), a last flush (within the Redis client's timeouts), the flusher
        stops."""
        for task in list(self._detached):
            task.cancel()
        if self._detached:
            await asyncio.wait(list(self._detached), timeout=5.0)
        with contextlib.suppress(Exception):
            await self.flush()
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(BaseException):
                await self._flusher
