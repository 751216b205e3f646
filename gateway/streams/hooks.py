"""Where routes meet resumable streams: a stream's body and clean-up wrapped when the gateway logs events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.streams.carry_record import carry_record
from gateway.streams.resumable import ResumableStream
from gateway.web.drain_middleware import DrainState


def id_prefix(api: str, stream_id: str) -> str:
    """Event ids: `<stream id>:<n>` on chat and completions (so `Last-Event-ID` alone names the stream), `<n>`
    (the event's `sequence_number`) on responses, whose id is in the resume URL."""
    return "" if api == "responses" else stream_id + ":"


def resumable(config: Any, prepared: Any, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
              drain: DrainState | None = None,
              gen: Any = None) -> tuple[AsyncIterator[bytes], Callable[[], Awaitable[None]]]:
    """The body and clean-up an `SSEResponse` gets: unchanged when event logs are off (`config.event_logs`).
    A draining gateway does not keep a stream whose client left. A stream (`gen`, a `Generation` or a
    `GenerationGroup`) can be carried on by another gateway if this one is lost
    (`gateway.streams.carry_on`)."""
    if config.event_logs is None:
        return body, on_close
    record = carry_record(prepared, gen) if gen is not None and config.carry_on else None
    stream_id = prepared.shape.id
    wrapped = ResumableStream(config.event_logs, prepared.tenant.name, stream_id, body, on_close,
                              id_prefix=id_prefix(prepared.req.api, stream_id),
                              detach_grace_s=config.stream_detach_grace_s,
                              draining=(lambda: drain.draining) if drain is not None else (lambda: False),
                              source=gen if record is not None else None,
                              carry=record.encode() if record is not None else None)
    return wrapped.body(), wrapped.close
