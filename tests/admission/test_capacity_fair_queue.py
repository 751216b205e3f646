"""CapacityGate waiters are fair across tenants: lowest admitted cost per weight first, lift on activation,
push-out of the longest queue when full, bounded accounts; `fair_queue=False` keeps one FIFO."""

from __future__ import annotations

import asyncio
import time

import pytest

from admission.capacity import BATCH, INTERACTIVE, CapacityGate, Overloaded, WorkerCapacity
from admission.fair_waiters import FairWaiters

pytestmark = pytest.mark.timeout(20)


class Workers:
    def __init__(self, free: int, total: int) -> None:
        self.view = WorkerCapacity("w0", free, total, updated_at=time.monotonic())

    def __call__(self) -> list[WorkerCapacity]:
        return [self.view]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def flood(gate: CapacityGate, key: str, n: int, cost: int = 100, weight: float = 1.0,
                priority=INTERACTIVE) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(gate.acquire(cost, priority, key, weight)) for _ in range(n)]
    await settle()
    return tasks


async def serve_in_order(gate: CapacityGate, first: asyncio.Task, tasks: list[tuple[str, asyncio.Task]],
                         rounds: int) -> list[str]:
    """Release one ticket at a time (capacity for exactly one waiter) and record whose waiter got it."""
    order: list[str] = []
    held = await first
    for _ in range(rounds):
        gate.release(held)
        await settle()
        done = [(k, t) for k, t in tasks if t.done()]
        assert len(done) == 1, "exactly one waiter is admitted per release"
        key, task = done[0]
        tasks.remove((key, task))
        order.append(key)
        held = task.result()
    gate.release(held)
    for _, t in tasks:
        t.cancel()
    await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
    return order


@pytest.mark.parametrize("fair", [True, False])
async def test_light_tenant_passes_a_flooding_tenant_only_when_fair(fair):
    gate = CapacityGate(Workers(100, 1000), admission_wait_ms=5000, fair_queue=fair)
    first = asyncio.create_task(gate.acquire(100, INTERACTIVE, "a"))  # takes the only room
    heavy = await flood(gate, "a", 6)
    light = await flood(gate, "b", 1)
    tasks = [("a", t) for t in heavy] + [("b", t) for t in light]
    order = await serve_in_order(gate, first, tasks, 3)
    assert order == (["b", "a", "a"] if fair else ["a", "a", "a"])
    assert gate.waiting == {INTERACTIVE: 0, BATCH: 0}


async def test_weight_two_gets_twice_the_admissions_when_both_wait():
    gate = CapacityGate(Workers(100, 1000), admission_wait_ms=5000)
    first = asyncio.create_task(gate.acquire(100, INTERACTIVE, "x"))
    two = await flood(gate, "w2", 40, weight=2.0)
    one = await flood(gate, "w1", 40, weight=1.0)
    tasks = [("w2", t) for t in two] + [("w1", t) for t in one]
    order = await serve_in_order(gate, first, tasks, 30)
    assert order.count("w2") == 20 and order.count("w1") == 10


async def test_priority_classes_still_come_first():
    gate = CapacityGate(Workers(100, 1000), admission_wait_ms=5000, interactive_reserve=0.0)
    first = asyncio.create_task(gate.acquire(100, INTERACTIVE, "a"))
    batch = await flood(gate, "b", 2, priority=BATCH)  # b is the fairer key, but batch
    inter = await flood(gate, "a", 2)
    order = await serve_in_order(gate, first, [("batch", t) for t in batch] + [("inter", t) for t in inter],
                                 3)
    assert order == ["inter", "inter", "batch"]


async def test_full_queue_pushes_out_the_longest_tenant_not_the_newcomer():
    gate = CapacityGate(Workers(100, 1000), admission_wait_ms=5000, max_queue=4)
    held = await gate.acquire(100, INTERACTIVE, "a")
    heavy = await flood(gate, "a", 4)
    with pytest.raises(Overloaded):
        await gate.acquire(100, INTERACTIVE, "a")  # a's own newcomer is shed
    light = await flood(gate, "b", 1)
    assert heavy[-1].done() and isinstance(heavy[-1].exception(), Overloaded)  # a's newest made room
    assert not light[0].done() and gate.waiting[INTERACTIVE] == 4
    assert gate.shed[INTERACTIVE] == 2
    gate.release(held)
    await settle()
    assert light[0].done()  # and b is served first
    gate.release(light[0].result())
    for t in heavy[:-1]:
        t.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)
    assert gate.waiting[INTERACTIVE] == 0


async def test_fifo_queue_sheds_the_newcomer_when_full():
    gate = CapacityGate(Workers(100, 1000), admission_wait_ms=5000, max_queue=2, fair_queue=False)
    held = await gate.acquire(100, INTERACTIVE, "a")
    heavy = await flood(gate, "a", 2)
    with pytest.raises(Overloaded):
        await gate.acquire(100, INTERACTIVE, "b")
    assert not any(t.done() for t in heavy)
    gate.release(held)
    for t in heavy:
        t.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)


async def test_keys_are_released_on_every_exit_path():
    gate = CapacityGate(Workers(100, 1000), admission_wait_ms=30)
    held = await gate.acquire(100, INTERACTIVE, "a")
    with pytest.raises(Overloaded):
        await gate.acquire(100, INTERACTIVE, "b")  # timed out
    cancelled = await flood(gate, "c", 1)
    cancelled[0].cancel()
    await asyncio.gather(*cancelled, return_exceptions=True)
    gate.release(held)
    gate.release(held)  # twice: no double count
    w = gate._waiters
    assert not w._active and set(w._idle) == {"a", "b", "c"}


def test_counters_lift_weight_and_bounded_accounts():
    w = FairWaiters(max_idle_keys=2)
    w.activate("a")
    w.charge("a", 1000)
    w.activate("b", weight=2.0)  # a newcomer starts at the active minimum, with no credit for the past
    assert w.counter("b") == 1000
    w.charge("b", 1000)
    assert w.counter("b") == 1500  # cost / weight
    w.deactivate("a")
    w.deactivate("b")
    w.activate("c")  # nobody active: starts at the floor (the last key to leave)
    assert w.counter("c") == 1500
    w.deactivate("c")
    assert len(w) == 2 and w.counter("a") == 0.0  # a, the oldest idle account, was forgotten
    with pytest.raises(ValueError):
        w.activate("d", weight=0.0)
