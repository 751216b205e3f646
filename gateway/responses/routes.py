"""Stored responses over HTTP: GET, DELETE, GET .../input_items, POST .../cancel, in the key's tenant."""

from __future__ import annotations

import re
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.flow.service import GatewayService
from gateway.responses.background import BackgroundRuns
from gateway.responses.response_store import reported
from gateway.streams.replay import Replay
from gateway.streams.resume_routes import carrier, replay_response
from gateway.web import api_errors
from gateway.web.api_errors import ApiError
from tenancy import Tenant

_RETRIEVE_QUERY = frozenset({"stream", "starting_after", "include_obfuscation", "include", "include[]"})


def _service(request: Request) -> GatewayService:
    return request.app.state.service


async def stored_response(request: Request) -> Response:
    """GET (the object), DELETE, or GET .../input_items of a stored response of the caller's tenant."""
    svc = _service(request)
    tenant = await svc.authenticate(request.headers.get("authorization"))
    rid = request.path_params["response_id"]
    if request.method == "DELETE":
        await request.app.state.conversations.delete_response(tenant, rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})
    if request.url.path.endswith("/input_items"):
        found = await request.app.state.conversations.stored_response(tenant, rid)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise api_errors.invalid("'order' must be asc or desc.", param="order")
        items = found["input_items"] if order == "asc" else found["input_items"][::-1]
        return JSONResponse({"object": "list", "data": items, "has_more": False,
                             "first_id": items[0]["id"] if items else None,
                             "last_id": items[-1]["id"] if items else None})
    if wants_stream(request):  # replay of the response's events, then their live tail
        return await resume_response(request, tenant, rid)
    _check_retrieve_query(request)
    return JSONResponse(reported(await request.app.state.conversations.stored_response(tenant, rid)))


def _check_retrieve_query(request: Request) -> None:
    """`starting_after` without `stream=true` (`resume_response` serves that) and `include` are not
    served: each a 400 naming it."""
    query = request.query_params
    for name in query:
        if name not in _RETRIEVE_QUERY:
            raise api_errors.invalid(f"Unrecognized query parameter: {name[:64]}", param=name[:64])
    if "starting_after" in query:
        raise api_errors.invalid("'starting_after' needs 'stream': true.", param="starting_after")
    for name in ("include", "include[]"):
        if name in query:
            raise api_errors.invalid(f"'{name}' is not supported by this server's Responses API yet.",
                                     param=name.removesuffix("[]"))


async def cancel_response(request: Request) -> Response:
    """POST .../cancel: stop a queued or running background response of the caller's tenant (`cancelled`)."""
    svc = _service(request)
    tenant = await svc.authenticate(request.headers.get("authorization"))
    runs: BackgroundRuns = request.app.state.background
    return JSONResponse(await runs.cancel(tenant.name, request.path_params["response_id"]))


_RESPONSES_QUERY = frozenset({"stream", "starting_after", "include_obfuscation"})


def wants_stream(request: Request) -> bool:
    return (request.method == "GET"
            and request.query_params.get("stream", "false").lower() not in ("false", "0"))


async def resume_response(request: Request, tenant: Tenant, response_id: str) -> Response:
    """GET /v1/responses/{id}?stream=true: its events after `starting_after` (or `Last-Event-ID`; default:
    from the first), then the live tail. `include_obfuscation` is accepted and ignored (never obfuscated)."""
    config = request.app.state.config
    query = request.query_params
    for name in query:
        if name not in _RESPONSES_QUERY:
            raise api_errors.invalid(f"Unrecognized query parameter: {name[:64]}", param=name[:64])
    if query["stream"].lower() not in ("true", "1"):
        raise api_errors.invalid("'stream' must be true or false.", param="stream")
    if config.event_logs is None:
        raise api_errors.invalid("This gateway keeps no stream events, so a response cannot be "
                                 "streamed again.", param="stream")
    after = query.get("starting_after", request.headers.get("last-event-id", "-1")).strip()
    if not re.fullmatch(r"-1|\d{1,9}", after):
        raise api_errors.invalid("'starting_after' must be an event's sequence_number.",
                                 param="starting_after")
    if not response_id.startswith("resp_"):
        raise api_errors.response_not_found(response_id)
    svc = request.app.state.service
    replay = Replay(config.event_logs.redis, tenant.name, response_id, int(after), responses=True,
                    deadline_s=svc.config.request_timeout_s, carry=carrier(request))
    try:
        await replay.check()
    except ApiError as exc:
        if exc.status != 404:
            raise
        doc = await request.app.state.conversations.stored_response(tenant, response_id)  # 404 unless stored
        if reported(doc)["status"] not in ("queued", "in_progress") or "run_deadline" not in doc:
            raise api_errors.invalid("This response has no stream events to send: it ran neither streamed "
                                     "nor in the background, or its events expired.",
                                     param="stream") from None
        # a background run before its first token: tail the log it will write
        replay.starts_by = time.monotonic() + max(0.0, doc["run_deadline"] - time.time())
    return replay_response(request, replay)
