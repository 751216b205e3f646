"""A request's money hold, run beside its token admission: the two Redis calls overlap instead of taking
turns, and so do the two settles when the request ends."""

from __future__ import annotations

import asyncio

from admission import AdmissionTicket, BudgetExceeded, LevelRateLimited, MoneyGate, MoneyHold
from gateway.openai.bodies import Usage
from gateway.telemetry import gateway_metrics
from gateway.web import api_errors
from gateway.web.api_errors import ApiError
from tenancy import QuotaServiceUnavailable


class MoneyStep:
    """Made as the token admission starts, it holds the maximum cost at once; `join` waits for the hold once
    the tokens are admitted; `cancel` gives it back when they are not; `start_settle` (request over) and
    `settled` bracket the token settle."""

    def __init__(self, money: MoneyGate, project: str, key_digest: str, model: str, user: str | None,
                 prompt_tokens: int, max_tokens: int, batch: bool) -> None:
        self.money = money
        self._hold = asyncio.ensure_future(money.hold(project, key_digest, model, user, prompt_tokens,
                                                      max_tokens, batch))
        self._settle: asyncio.Future | None = None

    async def cancel(self) -> None:
        """The token admission refused the request: a hold that was taken is refunded."""
        try:
            hold = await self._hold
        except Exception:  # refused or unreachable: nothing is held
            return
        await self.money.settle(hold, False, 0, 0, 0)

    async def join(self, ticket: AdmissionTicket) -> MoneyHold:
        """The hold; a refusal refunds the ticket's tokens in full and raises the client's error."""
        try:
            hold = await self._hold
        except BudgetExceeded as exc:
            ticket.unserved()
            gateway_metrics.current().count_shed("insufficient_quota")
            raise ApiError(429, exc.message(), "insufficient_quota", code="insufficient_quota",
                           headers=exc.headers()) from None
        except LevelRateLimited as exc:
            ticket.unserved()
            gateway_metrics.current().count_shed(exc.code)
            raise ApiError(exc.status, exc.message(), exc.error_type, code=exc.code,
                           headers=exc.headers()) from None
        except QuotaServiceUnavailable:
            ticket.unserved()
            gateway_metrics.current().count_shed("quota_service_unavailable")
            raise api_errors.quota_unavailable() from None
        ticket.headers.update(hold.headers())
        return hold

    def start_settle(self, hold: MoneyHold, ticket: AdmissionTicket, usage: Usage) -> None:
        """The request is over: settle what it was served, while the token reservation settles too."""
        self._settle = asyncio.ensure_future(self.money.settle(
            hold, ticket.reservation.served, usage.prompt_tokens, usage.cached_tokens,
            usage.completion_tokens))

    async def settled(self) -> None:
        """Wait for the settle `start_settle` began; without one (the request ended before its hold was
        joined), give back whatever was held."""
        if self._settle is not None:
            await self._settle
        else:
            await self.cancel()
