"""The gateway's single entry point to admission: the tenant's budget first, then KV capacity.

Free of any HTTP framework: `error_response` describes each refusal as status, OpenAI error fields and
headers.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from admission.budget import Reservation
from admission.capacity import CapacityGate, CapacityNeverFits, CapacityTicket, Overloaded, TtftUnattainable
from admission.headers import rate_limit_headers, retry_headers
from admission.hold import BudgetGuard
from admission.results import QuotaExceeded, RequestTooLarge, TenantRejected
from admission.ttft_predict import TtftTarget
from common.priorities import Priority
from tenancy.schema import Tenant
from tenancy.tenancy_errors import QuotaServiceUnavailable

QUOTA_UNAVAILABLE_RETRY_MS = 1000


@dataclass(slots=True)
class AdmissionTicket:
    """An admitted request: response headers and the usage to settle with."""

    reservation: Reservation
    capacity: CapacityTicket | None
    headers: dict[str, str] = field(default_factory=dict)

    def record_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.reservation.prompt_tokens = min(self.reservation.prompt_tokens, max(0, int(prompt_tokens)))
        self.reservation.record(completion_tokens, cached_tokens)

    def unserved(self) -> None:
        """The request never reached a worker (e.g. no live worker): refund it fully, meter nothing."""
        self.reservation.unserved()


class Admission:
    """Budget (Redis) + optional capacity gate, as one context manager per request."""

    def __init__(self, guard: BudgetGuard, capacity: CapacityGate | None = None) -> None:
        self.guard = guard
        self.capacity = capacity

    @contextlib.asynccontextmanager
    async def admit(self, tenant: Tenant, prompt_tokens: int, max_tokens: int, priority: Priority,
                    expected_cached_tokens: int = 0, capacity: CapacityGate | None = None,
                    slo: TtftTarget | None = None) -> AsyncIterator[AdmissionTicket]:
        """`capacity`: the gate of the request's pool (model version), else this Admission's own; `slo`: the
        request's TTFT target (shed at once, fully refunded, when the gate predicts it missed)."""
        gate = capacity if capacity is not None else self.capacity
        res = await self.guard.acquire(tenant, prompt_tokens, max_tokens)
        cap: CapacityTicket | None = None
        try:
            if gate is not None:
                cost = max(0, prompt_tokens + max_tokens - expected_cached_tokens)
                prefill = max(0, prompt_tokens - expected_cached_tokens)
                try:
                    cap = await gate.acquire(cost, priority, tenant.name, tenant.weight, prefill=prefill,
                                             slo=slo)
                except (Overloaded, CapacityNeverFits):
                    res.unserved()
                    raise
            yield AdmissionTicket(res, cap, rate_limit_headers(res.result))
        finally:
            if cap is not None and gate is not None:
                gate.release(cap)
            await self.guard.release(res)

    @contextlib.asynccontextmanager
    async def carried(self, res: Reservation) -> AsyncIterator[AdmissionTicket]:
        """The ticket of a stream carried on from a lost gateway: its reservation, renewed here and settled
        once when the stream ends (no new reservation, no capacity slot: its tokens were admitted)."""
        self.guard.adopt(res)
        try:
            yield AdmissionTicket(res, None, {})
        finally:
            await self.guard.release(res)

    async def charge_invalid(self, tenant: Tenant) -> int:
        """One request of the tenant's per-minute limit for a request refused as invalid
        (`Budget.charge_invalid`)."""
        return await self.guard.budget.charge_invalid(tenant)

    async def aclose(self) -> None:
        await self.guard.aclose()


@dataclass(slots=True, frozen=True)
class ErrorSpec:
    """How the gateway should answer an admission exception."""

    status: int
    type: str
    code: str
    message: str
    headers: dict[str, str]


def error_response(exc: BaseException) -> ErrorSpec | None:
    """HTTP status, OpenAI error type/code, message and headers for an admission error (None: not one)."""
    if isinstance(exc, QuotaExceeded):
        kind = "tokens" if exc.result.limit_name == "tokens" else "requests"
        return ErrorSpec(429, kind, "rate_limit_exceeded", str(exc), rate_limit_headers(exc.result))
    if isinstance(exc, RequestTooLarge):
        return ErrorSpec(400, "invalid_request_error", "request_too_large", str(exc),
                         rate_limit_headers(exc.result))
    if isinstance(exc, CapacityNeverFits):
        return ErrorSpec(400, "invalid_request_error", "request_too_large", str(exc), {})
    if isinstance(exc, TenantRejected):
        return ErrorSpec(401, "invalid_request_error", "invalid_api_key", str(exc), {})
    if isinstance(exc, TtftUnattainable):
        return ErrorSpec(503, "server_error", "ttft_slo_unattainable", str(exc),
                         retry_headers(int(exc.retry_after_s * 1000)))
    if isinstance(exc, Overloaded):
        return ErrorSpec(503, "server_error", "server_overloaded", str(exc),
                         retry_headers(int(exc.retry_after_s * 1000)))
    if isinstance(exc, QuotaServiceUnavailable):
        return ErrorSpec(503, "server_error", "quota_service_unavailable",
                         "The quota service is temporarily unavailable; please retry.",
                         retry_headers(QUOTA_UNAVAILABLE_RETRY_MS))
    return None
