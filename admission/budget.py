"""Per-tenant token budgets in Redis: reserve before a request, settle after it.

Each step is one atomic script call, so every gateway replica enforces the same limits; without
Redis the budget fails closed (503) or, with `fail_open`, falls back to `LocalLimiter`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

import redis.asyncio as aredis
from redis.exceptions import RedisClusterException, RedisError

from admission.local_limits import LocalLimiter
from admission.lua.scripts import CHARGE_INVALID, RENEW, RESERVE, SETTLE
from admission.results import ADMITTED, Renewal, ReserveResult, error_for
from tenancy.schema import INT_DEFAULTS, Tenant, bucket_key, config_key, leases_key, usage_key
from tenancy.tenancy_errors import QuotaServiceUnavailable

log = logging.getLogger("switchyard.admission")

USAGE_TTL_S = 400 * 86_400
UNDO_DELAYS_S = (0.5, 2.0, 10.0)  # settles of a reserve whose fate is unknown (the script may run late)


@dataclass(slots=True)
class Reservation:
    """An admitted request's hold on its tenant's budget; the gateway records usage on it."""

    tenant: Tenant
    lease_id: str
    prompt_tokens: int
    max_tokens: int
    result: ReserveResult
    completion_tokens: int = 0
    cached_tokens: int = 0
    served: bool = True              # False: never reached a worker; refund everything, meter nothing
    settled: bool = False
    lease_lost: bool = False         # expired during an outage and could not be taken again: end the request
    renewed_at: float = field(default_factory=time.monotonic)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def refund_tokens(self) -> int:
        if not self.served:
            return self.reserved_tokens
        return max(0, self.reserved_tokens - self.prompt_tokens - self.completion_tokens)

    def record(self, completion_tokens: int, cached_tokens: int | None = None) -> None:
        self.completion_tokens = max(0, int(completion_tokens))
        if cached_tokens is not None:
            self.cached_tokens = max(0, int(cached_tokens))

    def unserved(self) -> None:
        """Mark that the request was refused after reserving (e.g. shed for capacity): charge nothing."""
        self.served = False


class Budget:
    """Reserve/settle/renew against Redis for one gateway process."""

    def __init__(self, client: aredis.Redis, *, lease_ttl_s: float = 60.0,
                 concurrency_retry_cap_ms: int = 1000, fail_open: bool = False,
                 local: LocalLimiter | None = None) -> None:
        if fail_open and local is None:
            raise ValueError("fail_open needs a LocalLimiter")
        self.redis = client
        self.lease_ttl_s = lease_ttl_s
        self.fail_open = fail_open
        self._lease_ttl_ms = int(lease_ttl_s * 1000)
        self._conc_cap_ms = concurrency_retry_cap_ms
        self._local = local
        self._background: set[asyncio.Future] = set()
        self._degraded = False

    async def reserve(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Reservation:
        """Charge the tenant's budget or raise QuotaExceeded / RequestTooLarge / TenantRejected.

        Raises QuotaServiceUnavailable when Redis is unreachable and fail-open is off.
        """
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError("prompt_tokens and max_tokens must be >= 0")
        cost = prompt_tokens + max_tokens
        lease_id = os.urandom(12).hex()
        try:
            result = await self._reserve_shielded(tenant.name, cost, lease_id)
            if self._degraded:
                self._degraded = False
                log.warning("quota store reachable again; back to the shared budgets")
            if self._local is not None and result.admitted:
                self._local.track(tenant, cost, 1)
        except QuotaServiceUnavailable:
            self._undo_unknown(tenant.name, cost, lease_id)
            if not self.fail_open:
                raise
            assert self._local is not None
            if not self._degraded:
                self._degraded = True
                log.warning("quota store unreachable; admitting from this gateway's fail-open share")
            result = self._local.reserve(tenant, cost)
        if not result.admitted:
            raise error_for(result, tenant.name)
        return Reservation(tenant, lease_id, prompt_tokens, max_tokens, result)

    async def charge_invalid(self, tenant: Tenant) -> int:
        """Charge one request of the tenant's per-minute limit for an invalid request; returns the ms until
        the tenant has a request left (0: it has). Redis unreachable: nothing is charged (0)."""
        try:
            reply = await CHARGE_INVALID(self.redis, [config_key(tenant.name), bucket_key(tenant.name)],
                                         [INT_DEFAULTS["tpm"], INT_DEFAULTS["rpm"]])
        except QuotaServiceUnavailable:
            return 0
        return int(reply[2])

    async def _reserve_shielded(self, name: str, cost: int, lease_id: str) -> ReserveResult:
        # If the caller is cancelled while the script may already have charged, settle it as unserved.
        args = [cost, lease_id, self._lease_ttl_ms, INT_DEFAULTS["tpm"], INT_DEFAULTS["rpm"],
                INT_DEFAULTS["max_concurrent"], self._conc_cap_ms]
        task = asyncio.ensure_future(
            RESERVE(self.redis, [config_key(name), bucket_key(name), leases_key(name)], args))
        try:
            return ReserveResult.from_reply(await asyncio.shield(task))
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._undo_cancelled(t, name, cost, lease_id))
            raise

    def _undo_cancelled(self, task: asyncio.Future, name: str, cost: int, lease_id: str) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        result = ReserveResult.from_reply(task.result())
        if result.admitted:
            res = Reservation(Tenant(name=name), lease_id, 0, cost, result, served=False)
            undo = asyncio.ensure_future(_quietly(self.settle(res)))
            self._background.add(undo)
            undo.add_done_callback(self._background.discard)

    def _undo_unknown(self, name: str, cost: int, lease_id: str) -> None:
        """A reserve that failed on a timeout or a dropped connection may still have run in Redis: settle its
        lease as never served a few times over the next seconds (a lease that does not exist refunds nothing,
        and one that exists is refunded once), so it does not pin the tenant's concurrency for the lease
        TTL."""
        res = Reservation(Tenant(name=name), lease_id, 0, cost, ReserveResult(ADMITTED, None, *[0] * 11),
                          served=False)

        async def undo() -> None:
            for delay in UNDO_DELAYS_S:
                await asyncio.sleep(delay)
                res.settled = False
                with contextlib.suppress(Exception):
                    if await self.settle(res):
                        return

        task = asyncio.ensure_future(undo())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settle(self, res: Reservation) -> bool:
        """Release the lease, refund unused tokens and meter usage; True if this call released the lease.

        Idempotent per reservation. Raises QuotaServiceUnavailable if Redis is unreachable (the
        lease then expires by its TTL).
        """
        if res.settled:
            return False
        res.settled = True
        if res.result.local:
            assert self._local is not None
            self._local.release(res.tenant, res.refund_tokens, refund_request=not res.served)
            return True
        name = res.tenant.name
        day = time.strftime("%Y%m%d", time.gmtime())
        keys = [config_key(name), bucket_key(name), leases_key(name), usage_key(name, day)]
        args = [res.lease_id, res.refund_tokens, res.prompt_tokens, res.cached_tokens, res.completion_tokens,
                USAGE_TTL_S, INT_DEFAULTS["tpm"], INT_DEFAULTS["rpm"], 1 if res.served else 0]
        released, _level = await SETTLE(self.redis, keys, args)
        if released and self._local is not None:
            self._local.track(res.tenant, -res.refund_tokens, 0 if res.served else -1)
        return bool(released)

    async def renew(self, tenant_name: str, lease_ids: list[str]) -> Renewal:
        """Extend these leases of one tenant by the lease TTL; expired ones are taken again while the
        tenant is below max_concurrent, else reported lost."""
        if not lease_ids:
            return Renewal(0)
        reply = await RENEW(self.redis, [leases_key(tenant_name), config_key(tenant_name)],
                            [self._lease_ttl_ms, INT_DEFAULTS["max_concurrent"], *lease_ids])
        return Renewal.from_reply(reply)

    async def drop(self, tenant_name: str, lease_ids: list[str]) -> None:
        """Remove leases (best effort: one left behind expires by its TTL)."""
        try:
            await self.redis.zrem(leases_key(tenant_name), *lease_ids)
        except (RedisError, RedisClusterException, OSError) as exc:
            log.warning("could not drop %d lease(s) of tenant %s: %s", len(lease_ids), tenant_name,
                        type(exc).__name__)


async def _quietly(coro) -> None:
    with contextlib.suppress(Exception):
        await coro
