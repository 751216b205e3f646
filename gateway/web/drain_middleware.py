"""Lame-duck shutdown of a gateway process: SIGTERM stops new work, in-flight streams finish, exit 0.

New API requests get 503 `server_shutting_down` while draining, so load balancers move traffic and the
listener stays open.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.telemetry.gateway_metrics import API_PREFIX, current

log = logging.getLogger("switchyard.gateway")

RETRY_AFTER_S = 1
SHUTTING_DOWN = json.dumps({"error": {
    "message": "This gateway is shutting down; retry the request (another replica will take it).",
    "type": "server_error", "param": None, "code": "server_shutting_down"}}).encode()


@dataclass(slots=True)
class DrainState:
    in_flight: int = 0
    deadline: float | None = None  # time.monotonic() by which the drain ends; None: serving

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self, grace_s: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + grace_s
            log.info("draining: refusing new requests, finishing %d in flight within %.0fs",
                     self.in_flight, grace_s, extra={"in_flight": self.in_flight})

    def finished(self, now: float) -> bool:
        return self.deadline is not None and (self.in_flight == 0 or now >= self.deadline)


class DrainMiddleware:
    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith(API_PREFIX):
            if self.state.draining:
                current().count_shed("draining")
                await _refuse(send, SHUTTING_DOWN)
                return
            self.state.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.state.in_flight -= 1
            return
        if path == "/ready" and self.state.draining:
            await _refuse(send, b'{"status":"draining"}')
            return
        await self.app(scope, receive, send)


async def _refuse(send: Send, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class LameDuckServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting a drain of `state` for up to `grace_s` seconds."""

    def __init__(self, config: uvicorn.Config, state: DrainState, grace_s: float) -> None:
        super().__init__(config)
        self.drain = state
        self.grace_s = grace_s
        self._signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only flip flags, the tick does the rest. Unlike uvicorn's own
        # handler the signal is not re-raised after shutdown, so a finished drain exits 0.
        if self._signalled or sig not in (signal.SIGTERM, signal.SIGINT):
            self.should_exit = True
        self._signalled = True

    async def on_tick(self, counter: int) -> bool:
        if self._signalled and not self.drain.draining:
            self.drain.start(self.grace_s)
        if self.drain.finished(time.monotonic()) and not self.should_exit:
            if self.drain.in_flight:
                log.warning("drain grace period over with %d requests in flight", self.drain.in_flight)
            else:
                log.info("drained: nothing in flight, stopping")
            self.should_exit = True
        return await super().on_tick(counter)


def serve(app: ASGIApp, state: DrainState, grace_s: float, **uvicorn_options: object) -> int:
    """Serve `app` until a signal and its drain end; returns the exit code (0)."""
    config = uvicorn.Config(app, **uvicorn_options)  # type: ignore[arg-type]
    LameDuckServer(config, state, grace_s).run()
    return 0
