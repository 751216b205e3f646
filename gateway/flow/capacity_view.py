"""Capacity admission's view of the workers (KV room, measured step costs): a `CapacityGate`'s `views`.

A worker's used KV is the larger of what it reports and what this gateway committed to it (full cost until a
reported hit).
"""

from __future__ import annotations

from admission import WorkerCapacity
from router import Router


class RouterCapacity:
    """`CapacityGate` views of a `Router`: a `WorkerCapacity` per worker with stats (live or draining)."""

    def __init__(self, router: Router, pool: str | None = None) -> None:
        self.router = router
        # count only the workers of this pool label (traffic-class pools); None: every worker
        self.pool = pool

    def __call__(self) -> list[WorkerCapacity]:
        views: list[WorkerCapacity] = []
        pool_of = getattr(self.router.membership, "pool_of", None)
        for member in self.router.reporting():
            if self.pool is not None and pool_of is not None and pool_of(member.member_id) != self.pool:
                continue
            stats = member.stats
            assert stats is not None  # reporting members have stats
            used = max(stats.kv_total - stats.kv_free, int(self.router.committed(member.member_id)))
            views.append(WorkerCapacity(member.member_id, max(0, stats.kv_total - used), stats.kv_total,
                                        draining=stats.draining, updated_at=member.stats_at or 0.0,
                                        prefill_tps=stats.prefill_tps, step_s=stats.step_s,
                                        prefill_backlog=stats.prefill_backlog))
        return views
