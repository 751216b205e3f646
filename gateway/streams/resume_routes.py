"""Resuming a stream from any gateway replica: `Last-Event-ID` on POST /v1/chat/completions and
/v1/completions, and the replay response `GET /v1/responses/{id}?stream=true` is served with."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.streams.replay import Replay
from gateway.web import api_errors
from gateway.web.api_errors import ApiError
from gateway.web.sse import SSEResponse

_CHAT_ID = re.compile(r"^(chatcmpl-[0-9a-f]{32}(?:-\d+)?):(\d{1,9})$")
_COMPLETION_ID = re.compile(r"^(cmpl-[0-9a-f]{32}(?:-\d+)?):(\d{1,9})$")


def carrier(request: Request) -> Callable[[str, str], Awaitable[bool]] | None:
    """How a replay carries on a stream whose gateway was lost (None: carrying on is off)."""
    carry = request.app.state.carry
    return carry.claim if carry is not None else None


def replay_response(request: Request, replay: Replay) -> Response:
    """The replay as an SSE response; 503 while this gateway serves its maximum of them."""
    config = request.app.state.config
    logs = config.event_logs
    if logs.readers >= logs.max_readers:
        raise ApiError(503, f"This gateway serves its maximum of {logs.max_readers} resumed streams; retry.",
                       "server_error", code="server_overloaded", headers={"retry-after": "1"})
    logs.readers += 1

    async def done() -> None:
        logs.readers -= 1

    return SSEResponse(replay.events(), done, write_timeout_s=config.stream_write_timeout_s)


async def resume_completion(request: Request) -> Response:
    """POST with `Last-Event-ID: <stream id>:<n>`: the stream's events after n, then its live tail. The body
    is not read (the stream's request is the one that started it)."""
    config = request.app.state.config
    svc = request.app.state.service
    tenant = await svc.authenticate(request.headers.get("authorization"))
    if config.event_logs is None:
        raise api_errors.invalid("This gateway keeps no stream events, so a stream cannot be resumed.",
                                 param="Last-Event-ID")
    pattern = _CHAT_ID if request.url.path.endswith("/chat/completions") else _COMPLETION_ID
    match = pattern.match(request.headers["last-event-id"].strip())
    if match is None:
        raise api_errors.invalid("'Last-Event-ID' must be an event id of this endpoint's streams (<id>:<n>).",
                                 param="Last-Event-ID")
    replay = Replay(config.event_logs.redis, tenant.name, match[1], int(match[2]), id_prefix=match[1] + ":",
                    deadline_s=svc.config.request_timeout_s, carry=carrier(request))
    await replay.check()
    return replay_response(request, replay)
