"""Carrying on a stream whose gateway was lost: a reader that finds the stream's gateway gone claims it (one
gateway wins, `SET NX`), rebuilds its request from the carry record, replays its logged tokens through the
same framing (the events the log holds come out again and are dropped) and logs the live rest after them, so
every reader of the log, on any gateway, gets the whole stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np

from gateway.flow.carried import choice_steps, groups, start_carried, start_carried_group
from gateway.flow.choices import GenerationGroup, group_sse
from gateway.flow.generation import Prepared
from gateway.streams.carry_record import CarryRecord
from gateway.streams.event_log import (
    CACHED,
    CHOICES,
    CODES,
    DATA,
    END,
    FIRST,
    RUNS_KEY,
    TOKENS,
    EventLogs,
    StreamTaken,
    carry_key,
    gateway_lost,
    log_key,
    owner_key,
    run_member,
)
from gateway.telemetry import gateway_metrics
from gateway.web.api_errors import ApiError

log = logging.getLogger("switchyard.gateway")

MAX_CARRIED = 256  # streams one gateway carries on at once; past it a lost stream ends `stream_lost`
SWEEP_S = 0.5  # how often a gateway looks for background runs whose gateway was lost (nobody may read them)
MAX_SWEPT = 256  # runs looked at per sweep
# (api, generation, first delta, trace, request) -> the stream's SSE events, as its first gateway framed them
BodyBuilder = Callable[[str, Any, Any, Any, Any], AsyncIterator[bytes]]
# (generation, first delta, trace, sink, run deadline): a background run driven to its stored end
BackgroundDriver = Callable[[Any, Any, Any, Callable[[bytes], None], float], Awaitable[None]]


@dataclasses.dataclass(slots=True)
class Logged:
    """What the lost gateway logged: how many events, and the tokens they were made from (a group's: per
    step, its code and choice, and the cached prompt tokens it had seen)."""

    events: int
    tokens: list[int]
    codes: list[int]
    choices: list[int] | None = None
    cached: int = 0


def _ints(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<i4").tolist()


def read_logged(entries: list, grouped: bool = False) -> Logged | None:
    """The log's events and tokens; None when it cannot be carried on (ended, trimmed, or without tokens)."""
    logged = Logged(0, [], [], [] if grouped else None)
    for _, fields in entries:
        if END in fields:
            return None
        if int(fields[FIRST]) != logged.events or TOKENS not in fields or grouped and CHOICES not in fields:
            return None  # trimmed, or an entry without its tokens (or steps)
        logged.events += fields[DATA].count(b"\n\n")
        logged.tokens += _ints(fields[TOKENS])
        logged.codes += _ints(fields[CODES])
        if logged.choices is not None:
            logged.choices += _ints(fields[CHOICES])
            logged.cached = max(logged.cached, int(fields.get(CACHED, 0)))
    if grouped:
        return logged if len(logged.codes) == len(logged.choices or []) else None
    return logged if len(logged.codes) == logged.events else None


class CarryOn:
    """This gateway's carried-on streams."""

    def __init__(self, logs: EventLogs, service: Any, build_body: BodyBuilder,
                 parsers: dict[str, Callable[[Any], Any]],
                 continue_previous: Callable[[Any, Any], Awaitable[None]],
                 drive_background: BackgroundDriver | None = None) -> None:
        self.logs, self.service, self.build_body = logs, service, build_body
        self.parsers, self.continue_previous = parsers, continue_previous
        self.drive_background = drive_background  # `BackgroundRuns.carry_on`
        self._running: dict[str, asyncio.Task] = {}
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        """Sweep for lost background runs (a streamed request is carried on by its client's reconnect)."""
        if self.drive_background is not None:
            self._sweeper = asyncio.create_task(self._sweep(), name="background run sweeper")

    async def _sweep(self) -> None:
        suspects: set[bytes] = set()
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                suspects = await self._sweep_once(suspects)
            except Exception as exc:  # Redis down: the next sweep
                log.warning("background run sweep failed: %s", type(exc).__name__)

    async def _sweep_once(self, suspects: set[bytes]) -> set[bytes]:
        """Claim the listed runs found lost at this sweep and the one before (a run just starting may have
        no `live` key yet); drop those past their deadline. The runs found lost now."""
        redis = self.logs.redis
        await redis.zremrangebyscore(RUNS_KEY, "-inf", time.time())
        lost = set()
        for member in await redis.zrange(RUNS_KEY, 0, MAX_SWEPT - 1):
            tenant, _, response_id = member.decode().partition(" ")
            if log_key(tenant, response_id) in self._running \
                    or not await gateway_lost(redis, tenant, response_id):
                continue
            if member in suspects:
                await self.claim(tenant, response_id)
            else:
                lost.add(member)
        return lost

    async def claim(self, tenant: str, stream_id: str) -> bool:
        """Carry the stream on here if nobody does; True while this gateway or another one carries it."""
        redis, key = self.logs.redis, log_key(tenant, stream_id)
        if key in self._running:
            return True
        raw = await redis.get(carry_key(tenant, stream_id))
        record = CarryRecord.decode(raw) if raw is not None else None
        if record is None or record.tenant != tenant or len(self._running) >= MAX_CARRIED:
            return False
        owner = owner_key(tenant, stream_id)
        if not await redis.set(owner, self.logs.owner_id, nx=True, px=int(self.logs.live_ttl_s * 1000)):
            return await redis.exists(owner) > 0  # another gateway carries it on
        logged = read_logged(await redis.xrange(key), record.grouped)
        if logged is None:
            await redis.delete(owner)
            return False
        task = asyncio.create_task(self._run(record, logged), name=f"carry {stream_id}")
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))
        gateway_metrics.current().stream_resumes.labels("carried").inc()
        log.info("carrying on stream %s after %d events", stream_id, logged.events)
        return True

    async def _run(self, record: CarryRecord, logged: Logged) -> None:
        claimed = time.monotonic()
        stream = self.logs.open(record.tenant, record.stream_id, carry=record.encode(),
                                first_seq=logged.events, owned=True)
        whole, gen, seen = False, None, 0

        def sink(data: bytes) -> None:
            nonlocal seen
            seen += 1
            if seen <= logged.events:  # the log holds it already
                return
            if seen == logged.events + 1:
                log.info("stream %s: its first new event %.0f ms after the claim", record.stream_id,
                         1000 * (time.monotonic() - claimed))
            self.logs.append_or_stop(stream, data)

        try:
            prepared = await self._prepare(record)
            if record.grouped:
                gen = await self._start_group(record, prepared, logged)
                stream.source = gen
                async for data in _group_body(gen):
                    sink(data)
            else:
                gen = await start_carried(self.service, prepared, _reservation(record, prepared),
                                          record.money_hold(), groups(logged.tokens, logged.codes),
                                          record.first_cached)
                stream.source, stream.tokens_logged = gen, len(logged.tokens)
                stream.finish_logged = any(code & 3 for code in logged.codes)
                await self._single(record, prepared, gen, sink)
            whole = not stream.taken
        except StreamTaken:
            if gen is not None:
                gen.hand_over()
        except ApiError as exc:
            log.warning("stream %s could not be carried on: %s", record.stream_id, exc.code or exc.status)
        except Exception:
            log.exception("carrying on stream %s failed", record.stream_id)
        finally:
            self.logs.end(stream, whole=whole)
            if gen is not None:
                await gen.close()
            if record.run_deadline and not stream.taken:
                with contextlib.suppress(Exception):
                    await self.logs.redis.zrem(RUNS_KEY, run_member(record.tenant, record.stream_id))

    async def _single(self, record: CarryRecord, prepared: Prepared, gen: Any,
                      sink: Callable[[bytes], None]) -> None:
        """A single stream's events (a background run's, driven to its stored end), through `sink`."""
        trace = gateway_metrics.current().trace(prepared.priority.label, record.tenant, time.perf_counter(),
                                                "")
        first = await gen.next()
        if record.run_deadline and self.drive_background is not None:
            await self.drive_background(gen, first, trace, sink, record.run_deadline)
        else:
            async for data in self.build_body(record.api, gen, first, trace, prepared.req):
                sink(data)

    async def _start_group(self, record: CarryRecord, prepared: Prepared, logged: Logged) -> GenerationGroup:
        steps = choice_steps(logged.tokens, logged.codes, logged.choices or [], prepared.choices)
        return await start_carried_group(self.service, prepared, _reservation(record, prepared),
                                         record.money_hold(), steps, logged.choices or [],
                                         max(record.first_cached, logged.cached))

    async def _prepare(self, record: CarryRecord) -> Prepared:
        """The request again, as its first gateway prepared it (the same ids and creation time)."""
        svc = self.service
        tenant = await (svc.tenants.key_tenant(record.key_digest) if record.key_digest
                        else svc.tenants.tenant(record.tenant))  # the key's model scope applies again
        if tenant is None or not tenant.active or tenant.name != record.tenant:
            raise ApiError(403, "The stream's tenant or key is no longer active.", "permission_error")
        parse = self.parsers[record.api]
        _, prepared = await svc.parse_and_prepare(tenant, lambda: parse(json.loads(record.body)),
                                                  len(record.body), record.request_id, self.continue_previous)
        prepared.shape = dataclasses.replace(prepared.shape, id=record.stream_id, created=record.created)
        prepared.key_digest, prepared.raw_body = record.key_digest, record.body
        return prepared

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._running.values()):
            task.cancel()
        if self._running:
            with contextlib.suppress(Exception):
                await asyncio.wait(list(self._running.values()), timeout=5.0)


async def _group_body(group: GenerationGroup) -> AsyncIterator[bytes]:
    """A carried group's events: its logged steps framed again (the log holds their events), then live."""
    events = group.events()
    first = await anext(events, None)
    async for data in group_sse(group, first, events):
        yield data


def _reservation(record: CarryRecord, prepared: Prepared) -> Any:
    return record.lease.reservation(prepared.tenant) if record.lease is not None else None
