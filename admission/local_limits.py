"""Fail-open fallback: per-gateway token buckets used while Redis is unreachable.

Each gateway admits only its share of a tenant's limits (limit / live gateways), so together the
replicas stay near the limit. While Redis answers, the buckets follow what this gateway spent through it
(`track`), so a switch to fail-open continues from that spend instead of from full buckets (intermittent
errors would otherwise admit a full share on top of the shared budget).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from admission.results import ADMITTED, DENIED, NEVER_FITS, ReserveResult
from tenancy.schema import Tenant

WINDOW_S = 60.0
MAX_TRACKED = 100_000  # tenants whose buckets are kept (`track` drops the oldest past this)


@dataclass(slots=True)
class _LocalState:
    tok: float
    req: float
    ts: float
    active: int = 0


class LocalLimiter:
    """In-process per-tenant buckets sized to this gateway's share of the tenant's limits."""

    def __init__(self, live_gateways: Callable[[], int], clock: Callable[[], float] = time.monotonic) -> None:
        self._live = live_gateways
        self._clock = clock
        self._state: dict[str, _LocalState] = {}

    def _shares(self, tenant: Tenant) -> tuple[float, float, int]:
        n = max(1, int(self._live()))
        conc = math.ceil(tenant.max_concurrent / n) if tenant.max_concurrent else 0
        return tenant.tpm / n, tenant.rpm / n, conc

    def _refilled(self, tenant: Tenant) -> _LocalState:
        tpm, rpm, _ = self._shares(tenant)
        now = self._clock()
        st = self._state.get(tenant.name)
        if st is None:
            st = self._state[tenant.name] = _LocalState(tpm, rpm, now)
        elapsed = max(0.0, now - st.ts)
        st.ts = now
        if tpm:
            st.tok = min(tpm, st.tok + elapsed * tpm / WINDOW_S)
        if rpm:
            st.req = min(rpm, st.req + elapsed * rpm / WINDOW_S)
        return st

    def track(self, tenant: Tenant, tokens: int, requests: int) -> None:
        """Follow a charge (positive) or refund (negative) made through Redis: the buckets never go below
        empty nor above this gateway's share, and no slot is taken."""
        if len(self._state) >= MAX_TRACKED and tenant.name not in self._state:
            self._state.pop(next(iter(self._state)))  # bounded: the oldest tenant's buckets start over
        tpm, rpm, _ = self._shares(tenant)
        st = self._refilled(tenant)
        if tpm:
            st.tok = min(tpm, max(0.0, st.tok - tokens))
        if rpm:
            st.req = min(rpm, max(0.0, st.req - requests))

    def reserve(self, tenant: Tenant, cost: int) -> ReserveResult:
        tpm, rpm, conc = self._shares(tenant)
        st = self._refilled(tenant)
        if tenant.tpm and cost > tenant.tpm:
            return self._result(NEVER_FITS, None, tenant, st, 0, 0, cost)
        need_tok = min(cost, tpm)
        waits: list[tuple[float, str, int, int]] = []
        if tpm and st.tok < need_tok:
            waits.append(((need_tok - st.tok) * WINDOW_S / tpm, "tokens", math.ceil(tpm - st.tok), cost))
        if rpm and st.req < 1:
            waits.append(((1 - st.req) * WINDOW_S / rpm, "requests", math.ceil(rpm - st.req), 1))
        if conc and st.active >= conc:
            waits.append((1.0, "concurrency", st.active, 1))
        if waits:
            wait_s, name, used, requested = max(waits)
            return self._result(DENIED, name, tenant, st, math.ceil(wait_s * 1000) + 1, used, requested)
        if tpm:
            st.tok -= cost
        if rpm:
            st.req -= 1
        st.active += 1
        return self._result(ADMITTED, None, tenant, st, 0, 0, cost)

    def release(self, tenant: Tenant, refund_tokens: int, refund_request: bool = False) -> None:
        """End a locally admitted request: free its slot and give back unused tokens."""
        st = self._state.get(tenant.name)
        if st is None:
            return
        tpm, rpm, _ = self._shares(tenant)
        st.active = max(0, st.active - 1)
        if tpm:
            st.tok = min(tpm, st.tok + max(0, refund_tokens))
        if rpm and refund_request:
            st.req = min(rpm, st.req + 1)

    def _result(self, status: int, name: str | None, tenant: Tenant, st: _LocalState,
                retry_ms: int, used: int, requested: int) -> ReserveResult:
        tpm, rpm, conc = self._shares(tenant)
        return ReserveResult(
            status, name,
            int(tpm), max(0, int(st.tok)), _reset_ms(st.tok, tpm),
            int(rpm), max(0, int(st.req)), _reset_ms(st.req, rpm),
            conc, st.active, retry_ms, used, requested, local=True)


def _reset_ms(level: float, cap: float) -> int:
    if cap <= 0 or level >= cap:
        return 0
    return math.ceil((cap - level) * WINDOW_S / cap * 1000)
