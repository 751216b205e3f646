"""The unknown-key gate: a bare ASGI layer in front of the Starlette app that answers an API request whose
bearer key is missing, malformed or unknown with the 401 the app would give, without the app's middleware,
routing and exception handling (an unknown-key flood costs each request a header scan, a digest and the key
cache, or one Redis read). Known keys, Redis errors, a draining gateway and the administration API
(`/v1/organization/`, which takes admin keys) go on to the app."""

from __future__ import annotations

import json
import time
import uuid

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.telemetry import gateway_metrics
from gateway.web.request_io import CLIENT_ID, bearer_key, drop_small_body
from tenancy import key_digest, key_shape_ok

MISSING = "Missing API key: send 'Authorization: Bearer <key>'."
INVALID = "Invalid, revoked or disabled API key."
ADMIN_PATHS = "/v1/organization/"  # the administration API checks its own (admin) keys


def _body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


_BODIES = {MISSING: _body(MISSING), INVALID: _body(INVALID)}


class UnknownKeyGate:
    """Wraps the gateway app (`app.state.service` holds the key directory once the lifespan started it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.lines = gateway_metrics.UnauthenticatedLines()

    def __getattr__(self, name: str) -> object:  # `state` and the rest: the wrapped Starlette app's
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(gateway_metrics.API_PREFIX) or \
                path.startswith(ADMIN_PATHS):
            await self.app(scope, receive, send)
            return
        why = await self._refusal(scope)
        if why is None:
            await self.app(scope, receive, send)
            return
        await self._refuse(scope, receive, send, why)

    async def _refusal(self, scope: Scope) -> str | None:
        """Why the request is refused here (None: the app decides)."""
        state = getattr(self.app, "state", None)
        service = getattr(state, "service", None)
        drain = getattr(state, "drain", None)
        if service is None or (drain is not None and drain.draining):
            return None
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        key = bearer_key(header.decode("latin-1"))
        if key is None:
            return MISSING
        if not key_shape_ok(key):
            return INVALID
        try:
            owner = await service.tenants.key_owner(key_digest(key))
        except Exception:  # Redis unreachable or the look-up cap: the app answers (503 with retry-after)
            return None
        return INVALID if owner is None else None

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, why: str) -> None:
        start = time.perf_counter()
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        rid = given if CLIENT_ID.match(given) else "req-" + uuid.uuid4().hex
        body = _BODIES[why]
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"www-authenticate", b"Bearer"), (b"x-request-id", rid.encode())]
        if not await drop_small_body(dict(scope["headers"]), receive):
            # a body still on its way: the connection cannot be reused
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        gateway_metrics.current().requests.labels("401").inc()
        if self.lines.admit(time.monotonic()):
            gateway_metrics.log.info("%s %s %d", scope["method"], scope["path"], 401, extra={
                "status": 401, "duration_ms": round((time.perf_counter() - start) * 1000, 1),
                "request_id": rid})

