"""Capacity admission's view of the workers, adapted from the router's live membership.

`MembershipCapacity` is the `views` callable of an `admission.capacity.CapacityGate`:
for every live (or draining) worker it reports the KV tokens that are free *for
new commitments*. A worker only reserves a request's prompt pages at admission
and grows it page by page while decoding, so its own `kv_free` (free plus
evictable prefix-cache pages, in tokens) overstates the room: the requests it
runs will still take up to `max_tokens` each. The view therefore counts a
worker's used capacity as the larger of what it reports in use
(`kv_total - kv_free`) and the router's committed KV tokens for it
(`LoadTracker.committed`: this gateway's in-flight requests at their full cost,
net of reported cache hits, plus other gateways' requests at the mean cost; the
routing load also subtracts hits the gateway only expects). `with_gate_notify` wraps
the router's worker-client factory so that every stats frame, after the
membership has recorded it, wakes the gate's waiters (`CapacityGate.notify`).
A request's cost is `prompt + max_tokens` with an expected cache hit of 0: the
committed figure counts a hit only once the worker reports it, so admission does the same
(conservative for shared prefixes; `Admission.admit(expected_cached_tokens=)` is
where a prediction would go).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from admission.capacity import CapacityGate, WorkerCapacity
from router.client import WorkerClient
from router.membership import Membership
from router.ring import FALLBACK_DRAINING
from worker.protocol import WorkerStats


class MembershipCapacity:
    """`CapacityGate` views from a `Membership`: one `WorkerCapacity` per worker that may take work."""

    def __init__(self, membership: Membership | None = None) -> None:
        self.membership = membership  # may be attached after the gate is built (the membership needs the gate)

    def __call__(self) -> list[WorkerCapacity]:
        m = self.membership
        views: list[WorkerCapacity] = []
        if m is None:
            return views
        for mid in m.member_ids():
            status = m.status(mid)
            if status is not None and status != FALLBACK_DRAINING:
                continue  # dead, unknown or incompatible: not capacity
            member = m.member(mid)
            if member is None or member.stats is None:
                continue
            stats = member.stats
            used = max(stats.kv_total - stats.kv_free, int(m.loads.committed(mid)))
            views.append(WorkerCapacity(mid, max(0, stats.kv_total - used), stats.kv_total,
                                        draining=stats.draining, updated_at=member.stats_at or 0.0))
        return views


def with_gate_notify(factory: Callable[..., WorkerClient], gate: CapacityGate) -> Callable[..., WorkerClient]:
    """A worker-client factory whose stats callback also calls `gate.notify()` after the original."""

    def make(*args: Any, on_stats: Callable[[WorkerClient, WorkerStats], None] | None = None,
             **kwargs: Any) -> WorkerClient:
        def stats_then_notify(client: WorkerClient, stats: WorkerStats) -> None:
            if on_stats is not None:
                on_stats(client, stats)
            gate.notify()

        return factory(*args, on_stats=stats_then_notify, **kwargs)

    return make
