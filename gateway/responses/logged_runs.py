"""A background run's events in its log, so `GET /v1/responses/{id}?stream=true` can replay and tail it: the
run goes through the same typed events a streamed response sends (`gateway.responses.response_events`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.responses.response_events import stream_events
from gateway.streams.event_log import EventLogs
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


async def logged_run(logs: EventLogs, gen: Generation, first: Delta | None, trace: Any,
                     parts: list[str]) -> str | None:
    """Drive a background run to its end through the stream events, each logged; its text goes into `parts`.
    Its finish reason; the API error that ended it is raised again."""
    rec = _Recorder(gen, parts)
    rec.record(first)
    stream = logs.open(gen.prepared.tenant.name, gen.prepared.shape.id)
    whole = False
    try:
        async for data in stream_events(rec, first, trace, _stored):  # type: ignore[arg-type]
            logs.append(stream, data)
        whole = rec.error is None
    finally:
        logs.end(stream, whole=whole)
    if rec.error is not None:
        raise rec.error
    return rec.finish
