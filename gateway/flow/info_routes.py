"""The gateway's informational endpoints: the models a tenant may use (`/v1/models`) and the health and
readiness probes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.flow.service import GatewayService
from gateway.web import api_errors
from gateway.web.api_errors import ApiError


def _service(request: Request) -> GatewayService:
    return request.app.state.service


def _model_card(request: Request, model: str) -> dict:
    return {"id": model, "object": "model", "created": request.app.state.started, "owned_by": "switchyard"}


async def list_models(request: Request) -> Response:
    """The models (versions, model names and aliases) with a live worker that the tenant may use."""
    svc = _service(request)
    tenant = await svc.authenticate(request.headers.get("authorization"))
    return JSONResponse({"object": "list",
                         "data": [_model_card(request, m) for m in svc.pools.listing(tenant)]})


async def get_model(request: Request) -> Response:
    """One model by id (or alias) the tenant may use; 404 in OpenAI's shape otherwise."""
    svc = _service(request)
    tenant = await svc.authenticate(request.headers.get("authorization"))
    name = request.path_params["model"]
    try:
        svc.check_model(tenant, name)  # 404 unknown, 503 none of it live
    except ApiError as exc:
        if exc.code == "model_not_allowed":  # as OpenAI does: a model you may not use is not found
            raise api_errors.model_not_found(name) from None
        raise
    return JSONResponse(_model_card(request, name))


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    svc = _service(request)
    checks = {"worker": svc.ready, "redis": True}
    probe = request.app.state.config.ready_check
    if probe is not None:
        try:
            checks["redis"] = bool(await probe())
        except Exception:
            checks["redis"] = False
    ok = all(checks.values())
    return JSONResponse({"status": "ready" if ok else "not_ready", **checks}, status_code=200 if ok else 503,
                        headers={} if ok else {"retry-after": "1"})
