"""A gateway's dollar-budget step: hold the maximum cost before the worker, settle the exact cost after."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aredis

from admission.money.hierarchy import OrgDirectory
from admission.money.ledger import MoneyHold, MoneyLedger, MoneyPath
from admission.money.prices import PriceBook
from tenancy.tenancy_errors import QuotaServiceUnavailable

log = logging.getLogger("switchyard.admission")
# Pauses before the settle's retries: the settle script is idempotent (a hold is settled once), so a call that
# failed, or timed out after running, is tried again rather than losing the cost and keeping the hold.
SETTLE_RETRY_S = (0.05, 0.25, 1.0)


class MoneyGate:
    """Dollar budgets of the organization -> project -> key -> user path of each request."""

    def __init__(self, client: aredis.Redis, hold_ttl_s: float) -> None:
        self.orgs = OrgDirectory(client)
        self.ledger = MoneyLedger(client, PriceBook(client), hold_ttl_s)

    async def hold(self, project: str, key_digest: str, model: str, user: str | None, prompt_tokens: int,
                   max_tokens: int, batch: bool = False) -> MoneyHold:
        """Hold the maximum cost on every level, or raise `BudgetExceeded`, `LevelRateLimited` (or
        `QuotaServiceUnavailable`); `batch`: a Batch API request, at the batch fraction of the prices."""
        org = await self.orgs.org_of(project)
        path = MoneyPath(org, project, key_digest, model, user or None)
        return await self.ledger.reserve(path, prompt_tokens, max_tokens, batch)

    async def settle(self, hold: MoneyHold, served: bool, prompt_tokens: int, cached_tokens: int,
                     completion_tokens: int) -> None:
        """Charge what was served (nothing if the request never reached a worker) and free the hold; an
        unreachable Redis is tried again SETTLE_RETRY_S later (the script settles a hold once)."""
        for pause in (*SETTLE_RETRY_S, None):
            try:
                if served:
                    await self.ledger.settle(hold, prompt_tokens, cached_tokens, completion_tokens)
                else:
                    await self.ledger.refund(hold)
                return
            except QuotaServiceUnavailable as exc:
                if pause is None:
                    # The hold is given back when its lease ends (the reserve script sweeps it); the cost is
                    # lost.
                    log.warning("money settle of hold %s failed: %s", hold.hold_id, exc)
                    return
                await asyncio.sleep(pause)
