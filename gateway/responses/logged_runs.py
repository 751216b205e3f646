"""A background run's events in its log, so `GET /v1/responses/{id}?stream=true` can replay and tail it, and
another gateway can carry the run on if this one is lost: the run goes through the same typed events a
streamed response sends (`gateway.responses.response_events`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.responses.response_events import stream_events
from gateway.streams.carry_record import carry_record
from gateway.streams.event_log import RUNS_KEY, EventLogs, run_member
from gateway.web.api_errors import ApiError

if TYPE_CHECKING:
    from gateway.flow.generation import Delta, Generation


class _Recorder:
    """The run's generation as the event stream sees it; it keeps the run's text, finish reason and error."""

    def __init__(self, gen: Generation, parts: list[str]) -> None:
        self._gen, self.parts = gen, parts
        self.finish: str | None = None
        self.error: ApiError | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gen, name)

    def record(self, delta: Delta | None) -> Delta | None:
        if delta is not None:
            self.parts.append(delta.text)
            self.finish = delta.finish_reason or self.finish
        return delta

    async def next(self) -> Delta | None:
        try:
            return self.record(await self._gen.next())
        except ApiError as exc:
            self.error = exc
            raise


async def _stored(body: dict) -> bool:
    return True  # the run stores its response itself (`responses_background`)


async def run_events(gen: Generation, first: Delta | None, trace: Any, parts: list[str],
                     sink: Callable[[bytes], object]) -> str | None:
    """Drive a background run to its end through the stream events, each handed to `sink` (which raises
    `StreamTaken` when another gateway carries the run on: its caller hands the generation over); its text
    goes into `parts`. Its finish reason;
    the API error that ended it is raised again."""
    rec = _Recorder(gen, parts)
    rec.record(first)
    async for data in stream_events(rec, first, trace, _stored):  # type: ignore[arg-type]
        sink(data)
    if rec.error is not None:
        raise rec.error
    return rec.finish


async def logged_run(logs: EventLogs, gen: Generation, first: Delta | None, trace: Any, parts: list[str],
                     deadline: float) -> str | None:
    """`run_events` into the run's own log, listed in RUNS_KEY (by its deadline) while it runs so that a
    gateway can find it and carry it on should this one be lost."""
    p = gen.prepared
    record = carry_record(p, gen, deadline)
    stream = logs.open(p.tenant.name, p.shape.id, source=gen if record is not None else None,
                       carry=record.encode() if record is not None else None)
    member = run_member(p.tenant.name, p.shape.id)
    if record is not None:
        with contextlib.suppress(Exception):  # not listed: no gateway carries it on if this one is lost
            await logs.redis.zadd(RUNS_KEY, {member: deadline})
    whole = False
    try:
        finish = await run_events(gen, first, trace, parts, functools.partial(logs.append_or_stop, stream))
        whole = True
        return finish
    finally:
        logs.end(stream, whole=whole)
        if record is not None and not stream.taken:
            with contextlib.suppress(Exception):  # a sweeper drops it past its deadline
                await logs.redis.zrem(RUNS_KEY, member)
