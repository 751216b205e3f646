"""The capacity gate and TTFT targets: a request whose predicted time to first token (the wait for KV, the
prompts queued ahead, the workers' measured prefill rate and step time) exceeds its target is refused at once
with a retry-after for the excess; a feasible one is admitted; one that waits in the gate past its deadline is
shed then, before `admission_wait_ms`."""

from __future__ import annotations

import time

import pytest

from admission import CapacityGate, Overloaded, TtftTarget, TtftUnattainable, WorkerCapacity
from admission.capacity import INTERACTIVE
from admission.ttft_predict import WorkerLoad, predict_ttft_s, service_s

pytestmark = pytest.mark.timeout(20)


def view(kv_free: int, *, tps: float = 0.0, step_s: float = 0.0, backlog: int = 0) -> WorkerCapacity:
    return WorkerCapacity("w0", kv_free, 1000, updated_at=time.monotonic(), prefill_tps=tps, step_s=step_s,
                          prefill_backlog=backlog)


def target(ms: int) -> TtftTarget:
    return TtftTarget(ms, time.monotonic() + ms / 1000)


def test_prediction_adds_capacity_wait_queue_ahead_and_the_quickest_fitting_worker():
    slow = WorkerLoad(backlog=9000, prefill_tps=1000.0, step_s=0.01, fits=True)
    fast = WorkerLoad(backlog=0, prefill_tps=1000.0, step_s=0.01, fits=True)
    assert service_s(slow, 1000) == pytest.approx(10.01)
    assert predict_ttft_s([slow, fast], 1000, 0, 0.0) == pytest.approx(1.01)
    # 2000 prompt tokens ahead at the pool's 2000 tokens/s, after 0.5 s for capacity
    assert predict_ttft_s([slow, fast], 1000, 2000, 0.5) == pytest.approx(2.51)
    full = WorkerLoad(backlog=0, prefill_tps=1000.0, step_s=0.01, fits=False)
    assert predict_ttft_s([slow, full], 1000, 0, 0.0) == pytest.approx(10.01)  # only `slow` has room
    unmeasured = WorkerLoad(backlog=9000, prefill_tps=0.0, step_s=0.0, fits=True)
    assert predict_ttft_s([unmeasured], 1000, 0, 0.0) == 0.0  # nothing measured: nothing predicted


async def test_a_worker_backlog_past_the_target_is_shed_at_once_with_retry_after_for_the_excess():
    gate = CapacityGate(lambda: [view(1000, tps=1000.0, step_s=0.02, backlog=3000)], admission_wait_ms=5000)
    start = time.monotonic()
    with pytest.raises(TtftUnattainable) as exc:
        await gate.acquire(100, INTERACTIVE, "t", prefill=50, slo=target(500))
    assert time.monotonic() - start < 0.5  # refused at once, not after the bounded wait
    assert "500 ms" in str(exc.value) and "predicted 3070 ms" in str(exc.value)
    assert exc.value.retry_after_s == pytest.approx(2.6, abs=0.11)  # 3.07 s predicted - 0.5 s target
    assert gate.slo_shed[INTERACTIVE] == 1 and gate.shed[INTERACTIVE] == 0
    assert gate.waiting[INTERACTIVE] == 0


async def test_a_feasible_target_is_admitted_and_the_ticket_carries_its_prefill():
    views = [view(1000, tps=1000.0, step_s=0.02, backlog=100)]  # one stats sample, taken before it
    gate = CapacityGate(lambda: views, admission_wait_ms=5000)
    ticket = await gate.acquire(100, INTERACTIVE, "t", prefill=50, slo=target(1000))
    assert ticket.prefill == 50 and gate.slo_shed[INTERACTIVE] == 0
    # the admitted prompt counts as backlog until the worker's next stats sample
    assert gate.predict_ttft_s(100, 50, INTERACTIVE) == pytest.approx((100 + 50 + 50) / 1000 + 0.02)
    gate.release(ticket)


async def test_a_full_pool_with_nothing_drained_yet_predicts_the_fallback_wait():
    gate = CapacityGate(lambda: [view(0)], admission_wait_ms=5000, fallback_retry_s=5.0)
    start = time.monotonic()
    with pytest.raises(TtftUnattainable):
        await gate.acquire(100, INTERACTIVE, "t", slo=target(2000))
    assert time.monotonic() - start < 0.5
    short = CapacityGate(lambda: [view(0)], admission_wait_ms=50)
    with pytest.raises(Overloaded) as plain:  # without a target: the bounded wait, then server_overloaded
        await short.acquire(100, INTERACTIVE, "t")
    assert not isinstance(plain.value, TtftUnattainable) and short.shed[INTERACTIVE] == 1


async def test_a_waiter_is_shed_at_its_deadline_not_after_the_bounded_wait():
    views = [view(1000)]
    gate = CapacityGate(lambda: views, admission_wait_ms=5000, interactive_reserve=0.0)
    held = await gate.acquire(900, INTERACTIVE, "a")
    gate.release(held)  # 900 tokens drained: a fast drain rate predicts a short wait
    views[0] = view(100)
    filler = await gate.acquire(100, INTERACTIVE, "a")
    views[0] = view(0)
    start = time.monotonic()
    with pytest.raises(TtftUnattainable) as exc:
        # 500 tokens short at ~900 tokens/s: ~0.56 s predicted, so it waits; nothing is released
        await gate.acquire(500, INTERACTIVE, "b", slo=target(800))
    waited = time.monotonic() - start
    assert 0.7 <= waited < 2.0, waited  # its deadline, far before admission_wait_ms
    assert "admitted any later, it would miss it" in str(exc.value)
    assert gate.waiting[INTERACTIVE] == 0
    gate.release(filler)


async def test_a_waiter_gives_up_when_the_workers_service_time_no_longer_fits_before_its_deadline():
    views = [view(1000, step_s=0.4)]
    gate = CapacityGate(lambda: views, admission_wait_ms=5000, interactive_reserve=0.0)
    gate.release(await gate.acquire(900, INTERACTIVE, "a"))  # a fast drain rate: a short predicted wait
    views[0] = view(100, step_s=0.4)
    filler = await gate.acquire(100, INTERACTIVE, "a")
    views[0] = view(0, step_s=0.4)
    start = time.monotonic()
    with pytest.raises(TtftUnattainable):
        await gate.acquire(300, INTERACTIVE, "b", slo=target(1200))
    waited = time.monotonic() - start
    assert 0.6 <= waited < 1.0, waited  # 1.2 s less the 0.4 s step: admitted after, its token would be late
    gate.release(filler)
