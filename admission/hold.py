"""Holds a budget reservation for the life of a request, with its settle guaranteed.

Long streams have their leases renewed; the settle runs however the request ends (finish, error,
disconnect, cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from admission.budget import Budget, Reservation
from admission.results import Renewal
from tenancy.schema import Tenant
from tenancy.tenancy_errors import QuotaServiceUnavailable

log = logging.getLogger("switchyard.admission")


class BudgetGuard:
    """Reserve/settle with guaranteed settlement and lease renewal, for one gateway."""

    def __init__(self, budget: Budget, *, settle_timeout_s: float = 2.0) -> None:
        self.budget = budget
        self.settle_timeout_s = settle_timeout_s
        self._held: dict[str, Reservation] = {}
        self._settling: set[asyncio.Task] = set()
        self._renewer: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self._held)

    async def acquire(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Reservation:
        res = await self.budget.reserve(tenant, prompt_tokens, max_tokens)
        self._held[res.lease_id] = res
        if self._renewer is None and not res.result.local:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop(), name="lease-renewer")
        return res

    def adopt(self, res: Reservation) -> None:
        """Hold (renew, then settle) a reservation another gateway took: a stream carried on after that
        gateway was lost (`gateway.streams.carry_on`)."""
        self._held[res.lease_id] = res
        if self._renewer is None and not res.result.local:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop(), name="lease-renewer")

    async def release(self, res: Reservation) -> None:
        """Settle `res` (once); survives the caller's cancellation and never raises Redis errors."""
        self._held.pop(res.lease_id, None)
        if res.settled:
            return
        task = asyncio.get_running_loop().create_task(self._settle_logged(res))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        try:
            await asyncio.wait_for(asyncio.shield(task), self.settle_timeout_s)
        except TimeoutError:
            log.warning("settle of lease %s still pending after %.1fs", res.lease_id, self.settle_timeout_s)

    @contextlib.asynccontextmanager
    async def hold(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> AsyncIterator[Reservation]:
        res = await self.acquire(tenant, prompt_tokens, max_tokens)
        try:
            yield res
        finally:
            await self.release(res)

    async def _settle_logged(self, res: Reservation) -> None:
        try:
            await self.budget.settle(res)
        except QuotaServiceUnavailable:
            log.warning("could not settle lease %s of tenant %s: quota store unreachable; it expires by TTL",
                        res.lease_id, res.tenant.name)
        except Exception:
            log.exception("settle of lease %s failed", res.lease_id)

    async def _renew_loop(self) -> None:
        period = self.budget.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                await self.renew_due(period)
            except Exception:
                log.exception("lease renewal failed")

    async def renew_due(self, older_than_s: float) -> int:
        """Renew every held lease not renewed for `older_than_s`, one script call per tenant; returns how
        many are held now. An expired lease is taken again if there is room, else marked `lease_lost`."""
        now = time.monotonic()
        by_tenant: dict[str, list[Reservation]] = {}
        for res in self._held.values():
            if not res.result.local and not res.lease_lost and now - res.renewed_at >= older_than_s:
                by_tenant.setdefault(res.tenant.name, []).append(res)
        if not by_tenant:
            return 0
        results = await asyncio.gather(
            *(self.budget.renew(name, [r.lease_id for r in group]) for name, group in by_tenant.items()),
            return_exceptions=True)
        held = 0
        for group, result in zip(by_tenant.values(), results, strict=True):
            if isinstance(result, BaseException):
                log.warning("lease renewal for tenant %s failed: %s", group[0].tenant.name,
                            type(result).__name__)
                continue
            held += result.renewed + len(result.retaken)
            self._mark_lost(group, result, now)
            # settled while the renewal was on its way: the settle's ZREM came first, so undo the re-take
            gone = [lease for lease in result.retaken if lease not in self._held]
            if gone:
                await self.budget.drop(group[0].tenant.name, gone)
        return held

    def _mark_lost(self, group: list[Reservation], result: Renewal, now: float) -> None:
        lost = set(result.lost)
        for res in group:
            res.renewed_at = now
            if res.lease_id in lost:
                res.lease_lost = True
                log.warning("lease %s of tenant %s expired during a quota-store outage and the tenant is at "
                            "max_concurrent: ending its request", res.lease_id, res.tenant.name)
        if result.retaken:
            log.info("took back %d expired lease(s) of tenant %s", len(result.retaken), group[0].tenant.name)

    async def aclose(self) -> None:
        """Stop renewing and wait (bounded) for settles in progress."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=self.settle_timeout_s)
