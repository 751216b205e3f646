"""A request's time-to-first-token target: the tenant's or its class's default, tightened by the
`x-switchyard-ttft-slo-ms` header; its deadline for admission and the worker, and its SLO outcome metrics.
"""

from __future__ import annotations

import time
from typing import Protocol

from admission import TtftTarget
from common.priorities import Priority
from gateway.telemetry import gateway_metrics
from gateway.web.api_errors import invalid
from tenancy import Tenant

TTFT_HEADER = "x-switchyard-ttft-slo-ms"
MAX_TTFT_SLO_MS = 3_600_000  # an hour: a header above it is refused as invalid


class Prepared(Protocol):
    """What this module reads of a `gateway.flow.generation.Prepared` request."""

    tenant: Tenant
    priority: Priority
    ttft_slo_ms: int
    received: float
    slo_counted: bool


def default_target_ms(tenant: Tenant, priority: Priority, class_defaults: dict[Priority, int]) -> int:
    """The tenant's `ttft_slo_ms` when set, else its priority class's default; 0: no target."""
    return tenant.ttft_slo_ms or class_defaults.get(priority, 0)


def header_target_ms(default_ms: int, header: str | None) -> int:
    """The request's target: the header may only tighten the default (a looser value is bounded by it); with
    no default the header alone sets it. 400 naming the header unless it is an integer in [1, 3600000]."""
    if header is None:
        return default_ms
    text = header.strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_TTFT_SLO_MS:
        raise invalid(f"The {TTFT_HEADER} header must be an integer number of milliseconds in "
                      f"[1, {MAX_TTFT_SLO_MS}], got {header[:32]!r}.", param=TTFT_HEADER)
    value = int(text)
    return min(value, default_ms) if default_ms else value


def slo_target(p: Prepared) -> TtftTarget | None:
    """The capacity gate's view of the target (its deadline on the monotonic clock); None without one."""
    if p.ttft_slo_ms <= 0:
        return None
    return TtftTarget(p.ttft_slo_ms, p.received + p.ttft_slo_ms / 1000)


def worker_deadline(p: Prepared) -> float:
    """The target's deadline in unix seconds for the `gen` frame; 0.0 without a target."""
    if p.ttft_slo_ms <= 0:
        return 0.0
    return time.time() + (p.received + p.ttft_slo_ms / 1000 - time.monotonic())


def count_target(p: Prepared) -> None:
    """The request reaches admission with a target."""
    if p.ttft_slo_ms > 0:
        gateway_metrics.current().count_slo("target", p.priority.label, p.tenant.name)


def first_token(p: Prepared) -> None:
    """Its first token arrived: met or missed (once per request, whatever its choices)."""
    if p.ttft_slo_ms > 0 and not p.slo_counted:
        p.slo_counted = True
        late = time.monotonic() - p.received > p.ttft_slo_ms / 1000
        gateway_metrics.current().count_slo("missed" if late else "met", p.priority.label, p.tenant.name)


def ended(p: Prepared) -> None:
    """Its admitted generation ended: one that never had a first token and whose deadline passed counts as
    missed."""
    if p.ttft_slo_ms > 0 and not p.slo_counted and time.monotonic() - p.received > p.ttft_slo_ms / 1000:
        p.slo_counted = True
        gateway_metrics.current().count_slo("missed", p.priority.label, p.tenant.name)
