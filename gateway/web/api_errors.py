"""OpenAI-shaped errors: every failure a client sees is an `ApiError` rendered as `{"error": {...}}`.

OpenAI's statuses and body fields let the SDKs raise their typed exceptions.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from admission import retry_headers

log = logging.getLogger("switchyard.gateway")

INVALID_REQUEST = "invalid_request_error"


class ApiError(Exception):
    """An error response: HTTP status, OpenAI error fields and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400 for a request field of the wrong type or range."""
    return ApiError(400, message, INVALID_REQUEST, param=param, code=code)


def unauthorized(message: str = "Invalid or missing API key.") -> ApiError:
    return ApiError(401, message, INVALID_REQUEST, code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"})


def response_not_found(response_id: str) -> ApiError:
    """404: no stored response of this id for the caller's tenant (another tenant's is not found either)."""
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found")


def background_limit(limit: int, per_tenant: bool) -> ApiError:
    """Too many background responses in flight: the tenant's own (429, its quota) or this gateway's (503)."""
    if per_tenant:
        return ApiError(429,
                        f"Too many background responses in flight: at most {limit} per tenant on a gateway; "
                        "retry when one ends.", "requests", param="background", code="rate_limit_exceeded",
                        headers={"retry-after": "1"})
    return ApiError(503, f"This gateway runs its maximum of {limit} background responses; retry shortly.",
                    "server_error", param="background", code="server_overloaded",
                    headers={"retry-after": "1"})


def not_cancellable(response_id: str, status: str | None) -> ApiError:
    """400 for a cancel of a response that is not a running background one (None: not a background one)."""
    if status is None:
        why = "only responses created with 'background': true can be cancelled, and it was not"
    else:
        why = f"it is already {status}"
    return ApiError(400, f"Cannot cancel response '{response_id}': {why}.", param="response_id")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist.", INVALID_REQUEST,
                    param="model", code="model_not_found")


def model_not_allowed(model: str) -> ApiError:
    return ApiError(403, f"Your API key is not allowed to use the model '{model}'.",
                    "permission_error", param="model", code="model_not_allowed")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body exceeds the limit of {limit} bytes.", INVALID_REQUEST,
                    code="request_too_large")


def request_timeout(timeout_s: float) -> ApiError:
    """408 for a body that did not arrive in full within the body deadline (slow or stalled client)."""
    return ApiError(408, f"The request body was not received within {timeout_s:g} seconds.", INVALID_REQUEST,
                    code="request_timeout", headers={"connection": "close"})


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, f"Unsupported content type '{content_type[:100]}': send application/json.",
                    INVALID_REQUEST, code="unsupported_media_type")


def tenant_disabled() -> ApiError:
    """Ends a disabled tenant's in-flight request (an SSE error event once streaming)."""
    return ApiError(401, "The tenant of this API key was disabled.", INVALID_REQUEST, code="tenant_disabled")


def key_revoked() -> ApiError:
    """Ends the in-flight requests of a revoked or expired API key (an SSE error event once streaming)."""
    return ApiError(401, "The API key of this request was revoked or has expired.", INVALID_REQUEST,
                    code="api_key_revoked")


def lease_lost() -> ApiError:
    """Ends a request whose concurrency lease expired during a quota-store outage while the tenant's other
    requests filled its max_concurrent (an SSE error event once streaming)."""
    return ApiError(429, "This request's concurrency slot expired during a quota-service outage and your "
                    "other requests now use every slot (max_concurrent); retry when one ends.", "requests",
                    code="concurrency_lease_lost", headers={"retry-after": "1"})


def model_unavailable(model: str, why: str = "no worker of it is live", retry_after_s: int = 1) -> ApiError:
    """503: the model (version or alias) exists but cannot serve now."""
    return ApiError(503, f"The model '{model}' is unavailable right now ({why}); retry shortly.",
                    "server_error", param="model", code="model_unavailable",
                    headers={"retry-after": str(retry_after_s)})


def no_live_worker(retry_after_s: int = 1) -> ApiError:
    return ApiError(503, "No model worker is available right now; retry shortly.", "server_error",
                    code="no_live_worker", headers={"retry-after": str(retry_after_s)})


def invalid_requests_exhausted(retry_after_ms: int) -> ApiError:
    """429 before parsing: this tenant's requests per minute went on requests refused as invalid."""
    return ApiError(429,
                    f"Too many invalid requests: they used up your requests-per-minute limit; retry after "
                    f"{retry_after_ms / 1000:.1f}s.", "requests", code="rate_limit_exceeded",
                    headers=retry_headers(retry_after_ms))


def quota_unavailable() -> ApiError:
    return ApiError(503, "The quota service is unavailable; retry shortly.", "server_error",
                    code="quota_service_unavailable", headers={"retry-after": "1"})


def upstream_failed(message: str, retryable: bool) -> ApiError:
    if retryable:
        return ApiError(503, message, "server_error", code="worker_unavailable",
                        headers={"retry-after": "1"})
    return ApiError(500, message, "server_error", code="worker_error")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = ApiError(exc.status_code, str(exc.detail), INVALID_REQUEST, code=code,
                   headers=dict(exc.headers or {}))
    return err.response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    rid = request.scope.get("state", {}).get("request_id", "-")
    log.exception("internal error", extra={"request_id": rid})
    return ApiError(500, "Internal server error.", "server_error", code="internal_error").response()


def install_handlers(app) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
