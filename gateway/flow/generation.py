"""One request's stream through the gateway: the prepared request, worker chunks in, text deltas out
(`Generation`), the client-facing error for a failed worker stream, and the exit stack that settles it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from admission import AdmissionTicket
from common.priorities import Priority
from gateway.flow import deadlines
from gateway.flow.detokenize import IncrementalDetokenizer, StopMatcher
from gateway.flow.served_model import ServedModel
from gateway.flow.versions import Target
from gateway.openai.bodies import ResponseShape, TokenLogprob, Usage
from gateway.openai.schemas import GenerationRequest
from gateway.telemetry import gateway_metrics
from gateway.web import api_errors
from gateway.web.api_errors import ApiError, invalid
from router import NoWorkerAvailable, WorkerError
from tenancy import QuotaServiceUnavailable, Tenant, TenantDirectory
from worker.protocol import ErrorCode, OutItem

log = logging.getLogger("switchyard.gateway")
TENANT_RECHECK_S = 0.25  # plus the directory's 0.5 s cache: a disabled tenant's streams end within 1 s
TENANT_OUTAGE_BACKOFF_S = 5.0


@dataclass(slots=True)
class Prepared:
    request_id: str  # the HTTP request id (x-request-id), for logs
    req: GenerationRequest
    tenant: Tenant
    prompt_ids: list[int]
    stable_len: int | None
    max_tokens: int
    priority: Priority
    ns: bytes
    shape: ResponseShape
    # every prompt's ids (prompt_ids first); [] = just that
    batch: list[list[int]] = field(default_factory=list)
    key_digest: str = ""  # SHA-256 of the request's API key: a revoked key ends its streams ("": not checked)
    target: Target | None = None  # the model version serving it (None: the service's own model and router)
    raw_body: Any = None  # the body as the client sent it (a stream another gateway may carry on keeps it)
    money_hold: Any = None  # its `admission.money.MoneyHold` under dollar budgets
    ttft_slo_ms: int = 0  # its time-to-first-token target (gateway.flow.deadlines); 0: none
    received: float = field(default_factory=time.monotonic)  # prepared at: the target counts from here
    slo_counted: bool = False  # its SLO outcome was counted

    @property
    def prompts(self) -> list[list[int]]:
        return self.batch or [self.prompt_ids]

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.req.n

    @property
    def grouped(self) -> bool:
        """Served by `gateway.flow.choices` (several choices, chat tool calls or echo) rather than one plain
        stream; a Responses request is always one stream (its tool calls are split in
        `gateway.openai.responses_items`)."""
        tools = self.req.tools
        return self.choices > 1 or self.req.echo or (tools is not None and tools.active
                                                     and self.req.api != "responses")


@dataclass(slots=True)
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None


async def close_stack(stack: AsyncExitStack, request_id: str) -> None:
    """Run a request's exit stack (abort, settle admission) to the end even if the caller is cancelled."""
    task = asyncio.ensure_future(stack.aclose())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise
    except Exception:
        log.exception("error while closing request", extra={"request_id": request_id})


_LINK_TEXT = {
    "timeout": "The model worker stopped sending tokens.",
    "worker_lost": "The model worker serving this request was lost.",
    "incompatible": "The model worker runs an incompatible version.",
    "closed": "The connection to the model worker closed.",
    "protocol": "The model worker sent a malformed reply.",
    "draining": "The model worker shut down and no other worker could carry the stream on.",
}
_ADDRESS = re.compile(r"\b(?:tcp|ipc|inproc)://\S+")


def worker_error(exc: WorkerError) -> ApiError:
    """The client's error for a failed worker stream; link details (addresses, worker ids) stay in the log."""
    code = str(exc.code)
    log.warning("worker stream failed (%s): %s", code, exc.message)
    message = _ADDRESS.sub("<worker>", exc.message)
    if exc.code == ErrorCode.BAD_REQUEST:
        return invalid(f"The worker rejected the request: {message}")
    if exc.code == ErrorCode.CAPACITY and not exc.retryable:
        return invalid(f"The request can never fit on a worker: {message}", code="context_length_exceeded")
    if exc.code == ErrorCode.CAPACITY:
        return api_errors.upstream_failed(f"Generation failed ({code}): {message}", exc.retryable)
    return api_errors.upstream_failed(f"Generation failed ({code}): "
                                      f"{_LINK_TEXT.get(code, 'internal error.')}", exc.retryable)


@dataclass(slots=True)
class Generation:
    """One running request: worker chunks in, text deltas out. Close exactly once."""

    model: ServedModel
    prepared: Prepared
    chunks: AsyncIterator[OutItem]
    stack: AsyncExitStack
    usage: Usage
    headers: dict[str, str]
    first_token_timeout_s: float
    ticket: AdmissionTicket | None = None
    tenants: TenantDirectory | None = None  # re-checked while running (see the module docstring)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # every token consumed (a carried stream logs them)
    _recheck_at: float = 0.0
    _detok: IncrementalDetokenizer = field(init=False)
    _stops: StopMatcher = field(init=False)
    _closed: bool = False

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.model.byte_table)
        self._stops = StopMatcher(self.prepared.req.stop)
        self._recheck_at = time.monotonic() + TENANT_RECHECK_S

    async def next(self) -> Delta | None:
        """The next non-empty delta, the final one carrying finish_reason; None after the end."""
        while self.finish_reason is None:
            if self.ticket is not None and self.ticket.reservation.lease_lost:
                raise api_errors.lease_lost()
            if self.tenants is not None and time.monotonic() >= self._recheck_at:
                await self._check_tenant(self.tenants)
            chunk = await self._next_chunk()
            delta = self._consume(chunk)
            if delta is not None:
                return delta
        return None

    async def _check_tenant(self, tenants: TenantDirectory) -> None:
        """The tenant is still active and the request's API key still its own (not revoked)."""
        self._recheck_at = time.monotonic() + TENANT_RECHECK_S
        name, digest = self.prepared.tenant.name, self.prepared.key_digest
        try:
            tenant = await tenants.tenant(name)
            owner = await tenants.key_owner(digest) if digest else name
        except QuotaServiceUnavailable:
            # A Redis outage does not cut running streams (admission refuses new ones); a hung Redis
            # costs a stream one read timeout per TENANT_OUTAGE_BACKOFF_S, not per recheck.
            self._recheck_at = time.monotonic() + TENANT_OUTAGE_BACKOFF_S
            return
        if tenant is None or not tenant.active:
            raise api_errors.tenant_disabled()
        if owner != name:
            raise api_errors.key_revoked()

    async def _next_chunk(self) -> OutItem:
        try:
            if self.usage.completion_tokens == 0:
                async with asyncio.timeout(self.first_token_timeout_s):
                    return await anext(self.chunks)
            return await anext(self.chunks)
        except WorkerError as exc:
            self._unserved_if_nothing_sent()
            raise worker_error(exc) from None
        except NoWorkerAvailable:
            self._unserved_if_nothing_sent()
            gateway_metrics.current().count_shed("no_worker")
            raise api_errors.no_live_worker() from None
        except TimeoutError:
            self._unserved_if_nothing_sent()
            raise api_errors.upstream_failed("Timed out waiting for the first token.", True) from None
        except StopAsyncIteration:
            raise api_errors.upstream_failed("The worker stream ended without a finish reason.",
                                             True) from None

    def _unserved_if_nothing_sent(self) -> None:
        # A request that failed before producing anything costs the tenant nothing.
        if self.ticket is not None and self.usage.completion_tokens == 0:
            self.ticket.unserved()

    def _consume(self, chunk: OutItem) -> Delta | None:
        toks = chunk.tokens
        if toks and not self.usage.completion_tokens:
            deadlines.first_token(self.prepared)
        self.token_ids += toks
        self.usage.completion_tokens += len(toks)
        self.usage.cached_tokens = max(self.usage.cached_tokens, chunk.cached_tokens)
        stops = self._stops
        text = stops.feed(self._detok.feed(toks))
        logprobs = None
        if self.prepared.req.logprobs:
            logprobs = self.model.token_logprobs(toks, chunk.logprobs or [], chunk.top_ids,
                                                 chunk.top_logprobs)
        finish = chunk.finish_reason
        if stops.stopped:
            self.finish_reason = "stop"
        elif finish is not None:
            if finish not in ("stop", "length"):
                raise api_errors.upstream_failed(f"The worker ended the request ({finish}).", True)
            text += stops.feed(self._detok.flush())
            text += stops.flush()
            self.finish_reason = "stop" if stops.stopped else finish
        if self.finish_reason is None and not text and not logprobs:
            return None
        return Delta(text, logprobs, self.finish_reason)

    async def collect(self) -> tuple[str, list[TokenLogprob] | None]:
        """Run to the end: the whole text and logprobs (non-streaming responses)."""
        parts: list[str] = []
        logprobs: list[TokenLogprob] | None = [] if self.prepared.req.logprobs else None
        while (delta := await self.next()) is not None:
            parts.append(delta.text)
            if logprobs is not None and delta.logprobs:
                logprobs.extend(delta.logprobs)
        return "".join(parts), logprobs

    def hand_over(self) -> None:
        """Another gateway carries this stream on and settles it: closing it here aborts, charges nothing."""
        if self.ticket is not None:
            self.ticket.reservation.settled = True
        if self.prepared.money_hold is not None:
            self.prepared.money_hold.settled = True

    async def close(self) -> None:
        """Abort the worker request if still running and settle admission; idempotent, cancel-safe."""
        if self._closed:
            return
        self._closed = True
        deadlines.ended(self.prepared)
        await close_stack(self.stack, self.prepared.request_id)
