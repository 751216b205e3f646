"""HTTP endpoints of stored responses: GET, DELETE, GET .../input_items and POST .../cancel, scoped to the key's tenant."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.flow.service import GatewayService
from gateway.responses.background import BackgroundRuns
from gateway.responses.response_store import reported
from gateway.web import api_errors

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
    _check_retrieve_query(request)
    return JSONResponse(reported(await request.app.state.conversations.stored_response(tenant, rid)))


def _check_retrieve_query(request: Request) -> None:
    """Stream replay (`stream=true`, `starting_after`) and `include` are not served: each a 400 naming it."""
    query = request.query_params
    for name in query:
        if name not in _RETRIEVE_QUERY:
            raise api_errors.invalid(f"Unrecognized query parameter: {name[:64]}", param=name[:64])
    if query.get("stream", "false").lower() not in ("false", "0"):
        raise api_errors.invalid("Streaming a stored response (stream=true) is not supported yet; GET it without "
                                 "'stream' and poll until its status is final.", param="stream")
    for name in ("starting_after", "include", "include[]"):
        if name in query:
            raise api_errors.invalid(f"'{name}' is not supported by this server's Responses API yet.",
                                     param=name.removesuffix("[]"))


async def cancel_response(request: Request) -> Response:
    """POST .../cancel: stop a queued or running background response of the caller's tenant (`cancelled`)."""
    svc = _service(request)
    tenant = await svc.authenticate(request.headers.get("authorization"))
    runs: BackgroundRuns = request.app.state.background
    return JSONResponse(await runs.cancel(tenant.name, request.path_params["response_id"]))
