"""Predicted time to first token at admission, from the queue ahead and the workers' measured costs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class TtftTarget:
    """A request's time-to-first-token target: `target_ms`, due at `deadline` on the capacity gate's clock."""

    target_ms: int
    deadline: float


@dataclass(slots=True, frozen=True)
class WorkerLoad:
    """What one worker has ahead of a new request, and what its steps cost (0.0: not measured)."""

    backlog: int  # prompt tokens not yet prefilled: reported by the worker, plus those admitted since
    prefill_tps: float  # prompt tokens a second
    step_s: float  # one engine step
    fits: bool  # it has KV room for the request now


def service_s(load: WorkerLoad, prefill: int) -> float:
    """Seconds from reaching the worker to the first token: its backlog and this prompt at the measured
    prefill rate, then one step (the backlog is unknown, so not counted, before a rate is measured)."""
    if load.prefill_tps <= 0:
        return load.step_s
    return (load.backlog + prefill) / load.prefill_tps + load.step_s


def predict_ttft_s(loads: Sequence[WorkerLoad], prefill: int, ahead_prefill: int, wait_s: float) -> float:
    """`wait_s` for KV capacity, then the prompts of the waiters ahead at the pool's prefill rate, then the
    quickest worker that has room (any worker when none has)."""
    if not loads:
        return wait_s
    rate = sum(w.prefill_tps for w in loads)
    ahead_s = ahead_prefill / rate if rate > 0 else 0.0
    return wait_s + ahead_s + quickest_service_s(loads, prefill)


def quickest_service_s(loads: Sequence[WorkerLoad], prefill: int) -> float:
    """`service_s` on the quickest worker that has room (any worker when none has)."""
    candidates = [w for w in loads if w.fits] or list(loads)
    return min(service_s(w, prefill) for w in candidates)


def excess_retry_s(predicted_s: float, left_s: float, low: float, high: float) -> float:
    """Seconds until the queue should have drained enough for the target: the predicted excess, in
    [low, high], rounded up to 0.1 s."""
    return float(min(high, max(low, math.ceil((predicted_s - left_s) * 10) / 10)))
