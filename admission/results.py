"""What a budget reservation returns, and the errors a refused one raises (429, 400, 401)."""

from __future__ import annotations

from dataclasses import dataclass

ADMITTED, DENIED, NEVER_FITS, UNKNOWN_TENANT, DISABLED = 0, 1, 2, 3, 4

_LIMIT_LABEL = {
    "tokens": "tokens per minute (tpm)",
    "requests": "requests per minute (rpm)",
    "concurrency": "concurrent requests",
}


@dataclass(slots=True, frozen=True)
class ReserveResult:
    """Budget state after a reserve attempt. Limits of 0 mean "no limit"."""

    status: int
    limit_name: str | None          # on denial: "tokens" | "requests" | "concurrency"
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_ms: int            # time until the token bucket is full again
    limit_requests: int
    remaining_requests: int
    reset_requests_ms: int
    limit_concurrent: int
    active_concurrent: int          # leases held, including this one when admitted
    retry_after_ms: int             # on denial: when the failing limit will let this request in
    used: int                       # on denial: amount of the failing limit in use
    requested: int                  # on denial: amount this request needs of it
    local: bool = False             # decided by the fail-open local limiter, not Redis

    @classmethod
    def from_reply(cls, reply: list) -> ReserveResult:
        name = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
        nums = [int(x) for x in reply[2:]]
        return cls(int(reply[0]), name or None, *nums)

    @property
    def admitted(self) -> bool:
        return self.status == ADMITTED


@dataclass(slots=True, frozen=True)
class Renewal:
    """What one renewal call found: leases still held, expired ones taken again, and ones lost."""

    renewed: int
    retaken: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()  # expired while the tenant was at max_concurrent: their requests must end

    @classmethod
    def from_reply(cls, reply: list) -> Renewal:
        def ids(xs: list) -> tuple[str, ...]:
            return tuple(x.decode() if isinstance(x, bytes) else str(x) for x in xs)
        return cls(int(reply[0]), ids(reply[1]), ids(reply[2]))


class BudgetError(Exception):
    """A reservation that was not admitted; `result` holds the state for the response headers."""

    def __init__(self, message: str, result: ReserveResult) -> None:
        super().__init__(message)
        self.result = result


class QuotaExceeded(BudgetError):
    """429 rate_limit_exceeded."""


class RequestTooLarge(BudgetError):
    """400: the request costs more than the tenant's whole token bucket."""


class TenantRejected(BudgetError):
    """The tenant no longer exists or is disabled (401)."""


def error_for(result: ReserveResult, tenant: str) -> BudgetError:
    """The exception for a non-admitted result, with a message naming limit, used and requested."""
    if result.status == NEVER_FITS:
        return RequestTooLarge(
            f"This request needs {result.requested} tokens (prompt + max_tokens), more than the "
            f"tokens-per-minute limit of {result.limit_tokens} for tenant {tenant!r}, so it can never "
            f"be admitted. Reduce max_tokens or the prompt.", result)
    if result.status in (UNKNOWN_TENANT, DISABLED):
        state = "does not exist" if result.status == UNKNOWN_TENANT else "is disabled"
        return TenantRejected(f"Tenant {tenant!r} {state}.", result)
    label = _LIMIT_LABEL.get(result.limit_name or "", result.limit_name or "limit")
    limit = {"tokens": result.limit_tokens, "requests": result.limit_requests,
             "concurrency": result.limit_concurrent}.get(result.limit_name or "", 0)
    return QuotaExceeded(
        f"Rate limit reached for {label} for tenant {tenant!r}: limit {limit}, used {result.used}, "
        f"requested {result.requested}. Please try again in {result.retry_after_ms / 1000:.3g}s.", result)
