"""CapacityGate: admits by KV-token cost, holds a reserve for interactive, waits bounded, sheds with
retry-after."""

from __future__ import annotations

import asyncio
import time

import pytest

from admission.capacity import (
    BATCH,
    INTERACTIVE,
    CapacityGate,
    CapacityNeverFits,
    Overloaded,
    WorkerCapacity,
)

pytestmark = pytest.mark.timeout(20)


class Workers:
    """A mutable stand-in for the router's stats table (plain data, as the gateway adapter provides)."""

    def __init__(self, *free_total: tuple[int, int]) -> None:
        self.views = [WorkerCapacity(f"w{i}", f, t, updated_at=time.monotonic())
                      for i, (f, t) in enumerate(free_total)]

    def __call__(self) -> list[WorkerCapacity]:
        return self.views

    def report(self, i: int, kv_free: int) -> None:
        v = self.views[i]
        self.views[i] = WorkerCapacity(v.worker_id, kv_free, v.kv_total, updated_at=time.monotonic())


async def test_burst_cannot_over_admit_between_stats():
    workers = Workers((1000, 1000))
    gate = CapacityGate(workers, admission_wait_ms=50)
    tickets = [await gate.acquire(300, INTERACTIVE) for _ in range(3)]
    with pytest.raises(Overloaded):
        await gate.acquire(300, INTERACTIVE)  # stats still say 1000 free, but 900 is pending
    # fresh stats now include the three requests: pending no longer double-counts them
    workers.report(0, 100)
    await gate.acquire(100, INTERACTIVE)
    for t in tickets:
        gate.release(t)


async def test_interactive_admitted_while_batch_shed():
    workers = Workers((1000, 1000))
    gate = CapacityGate(workers, admission_wait_ms=100, interactive_reserve=0.2)
    b1 = await gate.acquire(500, BATCH)
    with pytest.raises(Overloaded) as exc:
        await gate.acquire(400, BATCH)  # would eat into the 200-token interactive reserve
    assert 1.0 <= exc.value.retry_after_s <= 30.0
    i1 = await gate.acquire(400, INTERACTIVE)  # interactive may use the reserve
    assert gate.shed == {INTERACTIVE: 0, BATCH: 1}
    gate.release(b1)
    gate.release(i1)


async def test_waiters_wake_on_release_interactive_first():
    workers = Workers((1000, 1000))
    gate = CapacityGate(workers, admission_wait_ms=2000, interactive_reserve=0.0)
    held = await gate.acquire(1000, INTERACTIVE)
    batch = asyncio.create_task(gate.acquire(600, BATCH))
    await asyncio.sleep(0.01)
    inter = asyncio.create_task(gate.acquire(600, INTERACTIVE))
    await asyncio.sleep(0.01)
    assert gate.waiting == {INTERACTIVE: 1, BATCH: 1}
    start = time.monotonic()
    gate.release(held)
    t_inter = await asyncio.wait_for(inter, 1)
    assert time.monotonic() - start < 0.1 and not batch.done()  # interactive went first, batch still waits
    gate.release(t_inter)
    t_batch = await asyncio.wait_for(batch, 1)
    gate.release(t_batch)
    assert gate.waiting == {INTERACTIVE: 0, BATCH: 0}


async def test_wait_is_bounded_and_retry_after_follows_drain_rate():
    workers = Workers((10_000, 10_000))
    gate = CapacityGate(workers, admission_wait_ms=200, interactive_reserve=0.0)
    # 5 requests of 2000 tokens finish within ~0.5 s: drain rate ≈ 10000 tokens / 1 s (window floor 1 s)
    for _ in range(5):
        gate.release(await gate.acquire(2000, INTERACTIVE))
    assert gate.drain_rate() == pytest.approx(10_000, rel=0.01)
    big = [await gate.acquire(2000, INTERACTIVE) for _ in range(5)]  # full
    start = time.monotonic()
    with pytest.raises(Overloaded) as exc:
        await gate.acquire(8000, INTERACTIVE)
    waited = time.monotonic() - start
    assert 0.19 <= waited < 0.5
    assert exc.value.retry_after_s == 1.0  # 8000 deficit / 10000 per s = 0.8 s, bounded below by 1 s
    with pytest.raises(Overloaded) as exc:
        await gate.acquire(8000, INTERACTIVE)
    for t in big:
        gate.release(t)


async def test_retry_after_grows_with_deficit_and_is_capped():
    workers = Workers((0, 100_000))
    gate = CapacityGate(workers, admission_wait_ms=10, interactive_reserve=0.0, max_retry_s=30)
    workers.report(0, 100_000)
    t = await gate.acquire(1000, INTERACTIVE)
    gate.release(t)  # drain rate = 1000 tokens/s
    workers.report(0, 0)
    with pytest.raises(Overloaded) as small:
        await gate.acquire(5000, INTERACTIVE)
    with pytest.raises(Overloaded) as huge:
        await gate.acquire(90_000, INTERACTIVE)
    assert small.value.retry_after_s == pytest.approx(5.0, abs=0.2)
    assert huge.value.retry_after_s == 30.0


async def test_never_fits_draining_and_cancellation():
    workers = Workers((1000, 1000))
    gate = CapacityGate(workers, admission_wait_ms=1000)
    with pytest.raises(CapacityNeverFits):
        await gate.acquire(1001, INTERACTIVE)
    held = await gate.acquire(1000, INTERACTIVE)
    waiting = asyncio.create_task(gate.acquire(500, INTERACTIVE))
    await asyncio.sleep(0.01)
    waiting.cancel()  # client went away while queued
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.waiting[INTERACTIVE] == 0
    gate.release(held)
    workers.views[0] = WorkerCapacity("w0", 1000, 1000, draining=True)
    gate2 = CapacityGate(workers, admission_wait_ms=20)
    with pytest.raises(Overloaded):
        await gate2.acquire(10, INTERACTIVE)  # the only worker is draining


async def test_overload_10x_sheds_excess_without_hanging():
    workers = Workers((4000, 4000), (4000, 4000))
    gate = CapacityGate(workers, admission_wait_ms=150, interactive_reserve=0.2)

    async def request(priority: str) -> str:
        try:
            async with gate.admit(1000, priority):
                await asyncio.sleep(0.05)
                return "ok"
        except Overloaded as exc:
            assert 1.0 <= exc.retry_after_s <= 30.0
            return "shed"

    start = time.monotonic()
    results = await asyncio.gather(*(request(INTERACTIVE if i % 4 == 0 else BATCH) for i in range(80)))
    assert time.monotonic() - start < 3.0
    assert results.count("ok") >= 8 and results.count("shed") > 0
    assert gate.shed[BATCH] > 0 and gate.shed[BATCH] >= gate.shed[INTERACTIVE]
    assert gate.waiting == {INTERACTIVE: 0, BATCH: 0}


async def test_drain_history_stays_bounded_on_a_busy_gateway():
    now = [1000.0]
    workers = Workers((10_000, 10_000))
    gate = CapacityGate(workers, admission_wait_ms=0, clock=lambda: now[0])
    # 200 releases a second for 120 s, never a shed: the history must not keep one entry per release
    for _ in range(120 * 200):
        gate.release(await gate.acquire(50, INTERACTIVE))
        now[0] += 0.005
    assert len(gate._drained) <= 64
    assert gate.drain_rate() == pytest.approx(200 * 50, rel=0.05)  # still the recent rate


async def test_a_key_shed_after_waiting_is_charged_for_its_wait():
    """A request shed after its wait used to leave its key's fair counter at the lowest, so the key could hold
    the head of the queue with a maximum-cost request again and again at no cost."""
    workers = Workers((0, 1000))
    gate = CapacityGate(workers, admission_wait_ms=30)
    gate._waiters.activate("other")  # a second key keeps counters of idle keys comparable
    with pytest.raises(Overloaded):
        await gate.acquire(900, INTERACTIVE, key="hog")
    assert gate._waiters.counter("hog") >= 900
    assert gate._waiters.counter("other") == 0

