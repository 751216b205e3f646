"""Background responses: stored, bounded gateway tasks, cancellable from any gateway, ended on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.openai.responses_shape import ResponsesShape, final_status
from gateway.responses.conversations import Conversations
from gateway.responses.logged_runs import logged_run, run_events
from gateway.responses.response_store import ResponseStore, reported
from gateway.streams.event_log import StreamTaken
from gateway.telemetry.gateway_metrics import RequestTrace
from gateway.web import api_errors
from gateway.web.api_errors import ApiError
from gateway.web.drain_middleware import DrainState

if TYPE_CHECKING:
    from gateway.flow.generation import Delta, Generation
    from gateway.flow.service import GatewayService
    from gateway.streams.event_log import EventLogs

log = logging.getLogger("switchyard.gateway")

MAX_PER_TENANT = 16  # background runs in flight per tenant on one gateway (429 past it)
MAX_PER_GATEWAY = 256  # background runs in flight on one gateway (503 past it)
WATCH_INTERVAL_S = 1.0  # how often a gateway looks for cancels asked on another (or deletes) of its runs
STOP_WAIT_S = 5.0  # a cancel, or the shutdown, waits this long for runs to record how they ended
# past its deadline by this, a run still in progress is reported failed (its gateway died)
LOST_AFTER_S = 60.0
SHUTDOWN_ERROR = {"code": "server_error", "message": "The gateway running this background response shut down "
                  "before it finished; create it again."}
TOO_LARGE_ERROR = {"code": "server_error", "message": "The response is larger than a stored response may be."}


@dataclass(slots=True)
class Run:
    tenant: str
    response_id: str
    task: asyncio.Task | None = None
    stop: str = ""  # why it is being stopped: "" (not), "cancel" or "shutdown"


def _error(exc: ApiError) -> dict:
    """A Response's `error` for an API error that ended a run (fixed codes: the message says more)."""
    code = {400: "invalid_prompt", 429: "rate_limit_exceeded"}.get(exc.status, "server_error")
    return {"code": code, "message": exc.message}


class BackgroundRuns:
    """This gateway's background runs: each holds a drain slot, so a drain waits for them (to its grace)."""

    def __init__(self, service: GatewayService, conversations: Conversations, drain: DrainState, *,
                 per_tenant: int = MAX_PER_TENANT, per_gateway: int = MAX_PER_GATEWAY) -> None:
        self.service, self.conversations, self.drain = service, conversations, drain
        self.per_tenant, self.per_gateway = per_tenant, per_gateway
        self._runs: dict[str, Run] = {}
        self._watcher: asyncio.Task | None = None
        self.logs: EventLogs | None = None  # set by the app: runs log their stream events for a streamed GET

    @property
    def store(self) -> ResponseStore:
        assert self.conversations.store is not None  # `reserve` and `cancel` check it
        return self.conversations.store

    def reserve(self, tenant: str, response_id: str) -> Run:
        """A run's slot (429 past the tenant's bound, 503 past the gateway's); `release` it if unused."""
        if self.conversations.store is None:
            raise api_errors.invalid("This gateway stores no responses, so it runs none in the background.",
                                     param="background")
        if sum(r.tenant == tenant for r in self._runs.values()) >= self.per_tenant:
            raise api_errors.background_limit(self.per_tenant, per_tenant=True)
        if len(self._runs) >= self.per_gateway:
            raise api_errors.background_limit(self.per_gateway, per_tenant=False)
        run = self._runs[response_id] = Run(tenant, response_id)
        self.drain.in_flight += 1
        return run

    def release(self, run: Run) -> None:
        if self._runs.pop(run.response_id, None) is not None:
            self.drain.in_flight -= 1

    async def launch(self, run: Run, gen: Generation, trace: RequestTrace,
                     on_close: Callable[[], Awaitable[None]]) -> dict:
        """Store the queued response, then run it as a task; the queued object is the POST's answer."""
        p = gen.prepared
        shape: ResponsesShape = p.shape  # type: ignore[assignment]
        deadline = time.time() + self.service.config.request_timeout_s + LOST_AFTER_S
        body = shape.response("queued", [])
        try:
            if not await self.conversations.save_background(p.tenant, p.req, body, deadline, start=True):
                raise api_errors.invalid("The request is larger than a stored response may be, so it cannot "
                                         "run in the background.", param="background")
        except BaseException:
            if gen.ticket is not None:
                gen.ticket.unserved()  # nothing reached a worker: refund it all
            await on_close()
            self.release(run)
            raise
        run.task = asyncio.create_task(self._drive(run, gen, trace, on_close, deadline),
                                       name=f"background {run.response_id}")
        run.task.add_done_callback(lambda _: self.release(run))
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch(), name="background watcher")
        return body

    async def _drive(self, run: Run, gen: Generation, trace: RequestTrace,
                     on_close: Callable[[], Awaitable[None]], deadline: float) -> None:
        parts: list[str] = []
        status, finish, error = "failed", None, None
        try:
            async with asyncio.timeout(self.service.config.request_timeout_s + 10):
                delta = await gen.next()
                trace.first_token(gen.usage.completion_tokens)
                await self._save(gen, "in_progress", [], deadline, final=False)
                if self.logs is not None:
                    finish = await logged_run(self.logs, gen, delta, trace, parts, deadline)
                    delta = None
                while delta is not None:
                    parts.append(delta.text)
                    finish = delta.finish_reason or finish
                    delta = await gen.next()
            status = final_status(finish)
        except StreamTaken:
            gen.hand_over()  # another gateway carries it on, stores how it ends and settles it
            return  # (`on_close` only aborts)
        except BaseException as exc:  # noqa: BLE001 - each way a run ends is stored
            status, error = self._ended(run, exc)
        finally:
            # aborts the worker request if still running and settles (refunds) the reservation
            await on_close()
        await self._save_final(gen, status, parts, deadline, finish, error)

    async def carry_on(self, gen: Generation, first: Delta | None, trace: RequestTrace,
                       sink: Callable[[bytes], object], deadline: float) -> None:
        """Run a background run on here whose gateway was lost (`gateway.streams.carry_on`): its events go to
        `sink`; it is cancellable from any gateway as the runs started here are; its end is stored."""
        p = gen.prepared
        run = self._runs[p.shape.id] = Run(p.tenant.name, p.shape.id, asyncio.current_task())
        self.drain.in_flight += 1
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch(), name="background watcher")
        parts: list[str] = []
        status, finish, error = "failed", None, None
        try:
            finish = await run_events(gen, first, trace, parts, sink)
            status = final_status(finish)
        except StreamTaken:
            gen.hand_over()
            return
        except BaseException as exc:  # noqa: BLE001 - each way a run ends is stored
            status, error = self._ended(run, exc)
        finally:
            self.release(run)
            await gen.close()
        await self._save_final(gen, status, parts, deadline, finish, error)

    def _ended(self, run: Run, exc: BaseException) -> tuple[str, dict | None]:
        """The status and error a run that raised `exc` is stored with."""
        if isinstance(exc, asyncio.CancelledError):
            return ("cancelled", None) if run.stop == "cancel" else ("failed", SHUTDOWN_ERROR)
        if isinstance(exc, TimeoutError):
            return "failed", {"code": "server_error",
                              "message": "The response did not finish within the request deadline."}
        if isinstance(exc, ApiError):
            return "failed", _error(exc)
        if not isinstance(exc, Exception):
            raise exc
        log.exception("background response %s failed", run.response_id, exc_info=exc)
        return "failed", {"code": "server_error", "message": "Internal server error."}

    async def _save_final(self, gen: Generation, status: str, parts: list[str], deadline: float,
                          finish: str | None, error: dict | None) -> None:
        if not await self._save(gen, status, parts, deadline, final=True, finish=finish, error=error) \
                and status != "cancelled":  # too large to store, or refused: cancelled or deleted meanwhile
            await self._save(gen, "failed", [], deadline, final=True, finish=finish, error=TOO_LARGE_ERROR)

    async def _save(self, gen: Generation, status: str, parts: list[str], deadline: float, *, final: bool,
                    finish: str | None = None, error: dict | None = None) -> bool:
        """Store the run's state; False when refused (cancelled, deleted, too large) or Redis failed."""
        p = gen.prepared
        shape: ResponsesShape = p.shape  # type: ignore[assignment]
        items = shape.output_items()
        if parts or status in ("completed", "incomplete"):
            items.feed("".join(parts))
            items.finish("completed" if status == "completed" else "incomplete")
        body = shape.response(status, items.items, finish, gen.usage if final else None, error)
        try:
            saved = await self.conversations.save_background(p.tenant, p.req, body, deadline, final=final)
        except Exception as exc:  # Redis down: GET reports the run failed once past its deadline
            log.warning("background response %s: storing its %s state failed: %s", body["id"], status,
                        type(exc).__name__)
            return False
        if not saved and final:
            log.info("background response %s ended %s; not stored (cancelled, deleted or too large)",
                     body["id"], status)
        return saved

    async def _watch(self) -> None:
        """Stop the runs a cancel (from any gateway) or a delete asked to stop; ends when no run is left."""
        while self._runs:
            await asyncio.sleep(WATCH_INTERVAL_S)
            runs = [r for r in self._runs.values() if not r.stop]
            if not runs:
                continue
            try:
                asked = await self.store.stop_asked([(r.tenant, r.response_id) for r in runs])
            except Exception as exc:
                log.warning("background watcher: reading cancels failed: %s", type(exc).__name__)
                continue
            for run, stop in zip(runs, asked, strict=True):
                if stop:
                    self._stop(run, "cancel")

    def _stop(self, run: Run, why: str) -> None:
        if run.task is not None and not run.stop:
            run.stop = why
            run.task.cancel()

    async def cancel(self, tenant: str, response_id: str) -> dict:
        """Cancel this tenant's background run, wherever it runs; its response as it ended (`cancelled`)."""
        store = self.conversations.store
        doc = None if store is None else await store.get(tenant, response_id)
        if store is None or doc is None:
            raise api_errors.response_not_found(response_id)
        resp = reported(doc)
        if not resp.get("background"):
            raise api_errors.not_cancellable(response_id, None)
        if resp["status"] == "cancelled":
            return resp  # a second cancel answers as the first (OpenAI: idempotent)
        if resp["status"] not in ("queued", "in_progress"):
            raise api_errors.not_cancellable(response_id, resp["status"])
        await store.cancel_run(tenant, response_id)
        run = self._runs.get(response_id)
        if run is not None and run.tenant == tenant and run.task is not None:
            self._stop(run, "cancel")
            await asyncio.wait({run.task}, timeout=STOP_WAIT_S)
        return await self._cancelled(tenant, response_id)

    async def _cancelled(self, tenant: str, response_id: str) -> dict:
        """After a cancel was asked: the run's own record, or (it runs on another gateway, or is lost)
        `cancelled` stored here; its gateway's watcher stops it within WATCH_INTERVAL_S, storing its usage."""
        doc = await self.store.get(tenant, response_id)
        if doc is None:
            raise api_errors.response_not_found(response_id)  # deleted meanwhile
        resp = doc["response"]
        if resp["status"] in ("queued", "in_progress"):
            resp = {**resp, "status": "cancelled", "error": None}
            await self.store.save_run(tenant, resp, doc["input_items"], doc["conversation"],
                                      run_deadline=doc["run_deadline"], final=True)
        elif resp["status"] != "cancelled":
            raise api_errors.not_cancellable(response_id, resp["status"])  # it ended before the cancel
        return resp

    async def shutdown(self) -> None:
        """Stop every run (each stores `failed` with a shutdown error) and the watcher, within STOP_WAIT_S."""
        tasks = [r.task for r in self._runs.values() if r.task is not None]
        for run in list(self._runs.values()):
            self._stop(run, "shutdown")
        if tasks:
            log.warning("shutdown: stopping %d background responses", len(tasks))
            await asyncio.wait(tasks, timeout=STOP_WAIT_S)
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(BaseException):
                await self._watcher
