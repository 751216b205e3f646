"""Outstanding KV tokens per worker: this gateway's own requests exactly, other gateways' from worker stats.

Routing counts a request net of the prefix hit it expects;
`committed` (for admission) only net of reported hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.protocol import WorkerStats

DEFAULT_SETTLE_S = 0.2
_COST_EWMA_ALPHA = 0.05


@dataclass(slots=True)
class _Inflight:
    cost: int  # KV tokens counted now
    full: int  # prompt + max_tokens, before any cache hit
    sent_at: float
    seen_at: float | None = None


@dataclass(slots=True)
class _WorkerLoad:
    mine_tokens: int = 0  # routing view: net of expected prefix hits
    mine_committed: int = 0  # admission view: net of reported hits only (full cost until the first output)
    others_requests: int = 0
    gone: bool = False  # left the membership; dropped once its last request is released
    inflight: dict[str, _Inflight] = field(default_factory=dict)


class LoadTracker:
    """Outstanding KV tokens per worker; callers pass the time (monotonic seconds) explicitly."""

    def __init__(self, *, settle: float = DEFAULT_SETTLE_S, initial_mean_cost: float = 512.0) -> None:
        self.settle = settle
        self.mean_cost = initial_mean_cost
        self._samples = 0
        self._workers: dict[str, _WorkerLoad] = {}

    def add(self, worker_id: str, rid: str, cost: int, now: float, expected_cached: int = 0) -> None:
        """Count request `rid` of `cost` KV tokens (prompt + max_tokens) against `worker_id`,
        net of the `expected_cached` prompt tokens until the worker reports the real figure."""
        w = self._workers.setdefault(worker_id, _WorkerLoad())
        if rid in w.inflight:
            raise ValueError(f"request {rid!r} is already in flight on {worker_id}")
        counted = max(0, cost - expected_cached)
        w.inflight[rid] = _Inflight(counted, cost, now)
        w.mine_tokens += counted
        w.mine_committed += cost

    def first_output(self, worker_id: str, rid: str, now: float, cached_tokens: int) -> None:
        """The worker answered: it has counted the request, and says how much of the prompt was cached."""
        w = self._workers.get(worker_id)
        entry = w.inflight.get(rid) if w else None
        if entry is not None and entry.seen_at is None:
            entry.seen_at = now
            exact = max(0, entry.full - cached_tokens)
            w.mine_tokens += exact - entry.cost
            w.mine_committed += exact - entry.full
            entry.cost = exact
            # a plain mean over the first samples (the initial guess goes at once), then an EWMA
            self._samples += 1
            self.mean_cost += max(_COST_EWMA_ALPHA, 1.0 / self._samples) * (exact - self.mean_cost)

    def release(self, worker_id: str, rid: str) -> None:
        w = self._workers.get(worker_id)
        entry = w.inflight.pop(rid, None) if w else None
        if entry is not None:
            w.mine_tokens -= entry.cost
            w.mine_committed -= entry.cost if entry.seen_at is not None else entry.full
            if w.gone and not w.inflight:
                del self._workers[worker_id]

    def on_stats(self, worker_id: str, stats: WorkerStats, now: float) -> None:
        w = self._workers.setdefault(worker_id, _WorkerLoad())
        w.gone = False
        counted = 0
        for entry in w.inflight.values():
            if (entry.seen_at is not None and entry.seen_at < now) or now - entry.sent_at >= self.settle:
                counted += 1
        w.others_requests = max(0, stats.running + stats.queue - counted)

    def forget(self, worker_id: str) -> None:
        """Drop a departed worker's state (its in-flight entries are released by their streams)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        if w.inflight:
            w.gone = True
        else:
            del self._workers[worker_id]

    def load(self, worker_id: str) -> float:
        w = self._workers.get(worker_id)
        if w is None:
            return 0.0
        return w.mine_tokens + w.others_requests * self.mean_cost

    def committed(self, worker_id: str) -> float:
        """Like `load`, but a request counts its full cost until the worker reports its cache hit:
        the conservative figure for capacity admission, which must not promise KV on a guess."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0.0
        return w.mine_committed + w.others_requests * self.mean_cost

    def loads(self) -> dict[str, float]:
        return {wid: self.load(wid) for wid in self._workers}

    def inflight_count(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return len(w.inflight) if w else 0

