"""Counter rules of the worker's VTC fair share (worker.engine.scheduling.fairness), without an engine."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from worker.engine.scheduling.fairness import FairShare

A, B, C = b"tenant-a", b"tenant-b", b"tenant-c"


@dataclass(slots=True)
class Req:
    fkey: bytes
    arrival: int


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_first_request_of_a_key_is_lifted_to_the_minimum_active_counter() -> None:
    fs = FairShare()
    fs.on_active(A)
    fs.on_active(C)
    fs.charge(A, decode=50)  # A: 100
    fs.charge(C, decode=15)  # C: 30
    fs.on_active(B)
    assert fs.counter(B) == 30.0
    # a key already above the minimum keeps its counter; a second request of an active key lifts nothing
    fs.charge(B, decode=20)  # B: 70
    fs.on_active(B)
    assert fs.counter(B) == 70.0
    fs.on_idle(B)
    fs.on_idle(B)
    fs.charge(C, decode=40)  # C: 110, A: 100 -> min 100
    fs.on_active(B)
    assert fs.counter(B) == 100.0


def test_lift_follows_charges_and_departures_of_the_minimum_key() -> None:
    fs = FairShare()
    for key in (A, B):
        fs.on_active(key)
    fs.charge(A, decode=5)  # A: 10, B: 0
    fs.charge(B, decode=10)  # B: 20: the min moves to A without any push
    fs.on_active(C)
    assert fs.counter(C) == 10.0
    fs.on_idle(C)
    fs.on_idle(A)  # active: B at 20
    fs.on_active(C)
    assert fs.counter(C) == 20.0


def test_no_active_key_lifts_to_the_last_key_that_went_idle() -> None:
    fs = FairShare()
    fs.on_active(A)
    fs.charge(A, prefill_computed=500)
    fs.on_idle(A)
    fs.on_active(B)  # B gets no credit for the time A had the worker alone
    assert fs.counter(B) == 500.0
    assert fs.counter(A) == 500.0


def test_lift_matches_brute_force_under_random_operations() -> None:
    rng = random.Random(7)
    fs = FairShare(max_keys=6)
    keys = [bytes([k]) for k in range(10)]
    for _ in range(3000):
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.35:
            active = [k for k in keys if fs.active_requests(k) and k != key]
            before = fs.counter(key)
            was_idle = fs.active_requests(key) == 0
            fs.on_active(key, weight=rng.choice((1.0, 2.0, 0.5)))
            if was_idle and active:
                assert fs.counter(key) == max(before, min(fs.counter(k) for k in active))
        elif op < 0.6:
            fs.on_idle(key)
        else:
            fs.charge(key, prefill_computed=rng.randrange(64), decode=rng.randrange(4))
        active = [k for k in keys if fs.active_requests(k)]
        assert fs.min_active_counter() == (min(fs.counter(k) for k in active) if active else None)


WEIGHTS = {A: 2.0, B: 1.0, C: 1.0}


def backlogged_service(fs: FairShare, steps: int, cost: dict[bytes, tuple[int, int]]) -> dict[bytes, float]:
    """Every key always has a request waiting; each pick is charged that key's (prefill, decode) cost."""
    arrival = 0
    heads = {}
    for key in cost:
        fs.on_active(key, weight=WEIGHTS[key])
        heads[key] = Req(key, arrival)
        arrival += 1
    for _ in range(steps):
        chosen = fs.pick(heads.values())
        assert chosen is not None
        prefill, decode = cost[chosen.fkey]
        fs.charge(chosen.fkey, prefill_computed=prefill, decode=decode)
        heads[chosen.fkey] = Req(chosen.fkey, arrival)  # its next request
        arrival += 1
    return {key: fs.service(key) for key in cost}


@pytest.mark.parametrize("cost", [
    {A: (0, 1), B: (0, 1)},  # equal decode steps
    {A: (120, 8), B: (30, 40)},  # different shapes: service counts tokens, not requests
])
def test_weight_two_key_gets_twice_the_service_when_both_are_backlogged(cost: dict) -> None:
    service = backlogged_service(FairShare(), 4000, cost)
    assert service[A] / service[B] == pytest.approx(2.0, rel=0.1)


def test_equal_weights_share_equally_and_fifo_does_not() -> None:
    cost = {B: (0, 1), C: (200, 1)}  # C's requests cost far more than B's
    fair = backlogged_service(FairShare(), 3000, cost)
    assert fair[B] / fair[C] == pytest.approx(1.0, rel=0.1)
    fifo = backlogged_service(FairShare(policy="fifo"), 3000, cost)
    assert fifo[C] / fifo[B] > 50  # arrival order alternates the keys: C gets ~100x the service


def test_only_computed_prefill_tokens_are_charged() -> None:
    fs = FairShare(w_prefill=1.0, w_decode=2.0)
    fs.on_active(A)
    fs.on_active(B)
    # both sent a 1000-token prompt; A's first 960 were in the prefix cache, so 40 were computed
    fs.charge(A, prefill_computed=40)
    fs.charge(B, prefill_computed=1000)
    assert fs.service(A) == 40.0 and fs.service(B) == 1000.0
    fs.charge(A, decode=3)
    assert fs.service(A) == 46.0
    assert fs.pick([Req(B, 0), Req(A, 1)]) == Req(A, 1)


def test_weight_divides_the_counter_but_not_the_service() -> None:
    fs = FairShare()
    fs.on_active(A, weight=4.0)
    fs.charge(A, prefill_computed=100, decode=10)
    assert fs.service(A) == 120.0
    assert fs.counter(A) == 30.0


def test_pick_prefers_the_lowest_counter_then_the_earliest_arrival() -> None:
    fs = FairShare()
    for key in (A, B, C):
        fs.on_active(key)
    fs.charge(A, decode=10)
    reqs = [Req(A, 0), Req(B, 3), Req(C, 2), Req(A, 1)]
    assert fs.pick(reqs) == Req(C, 2)  # B and C tie at 0: C arrived first
    assert fs.pick([]) is None


def test_preemption_victim_is_the_key_most_over_its_share() -> None:
    fs = FairShare()
    for key, weight in ((A, 1.0), (B, 2.0), (C, 1.0)):
        fs.on_active(key, weight)
    fs.charge(A, decode=100)  # counter 200
    fs.charge(B, decode=150)  # service 300 but counter 150: within its doubled share
    fs.charge(C, decode=120)  # counter 240, but has nothing running
    assert fs.preemption_victim([A, B]) == A
    assert fs.preemption_victim([B]) == B
    assert fs.preemption_victim([]) is None
    assert FairShare(policy="fifo").preemption_victim([A, B]) is None


def test_idle_keys_beyond_the_cap_are_forgotten_least_recent_first() -> None:
    clock = Clock()
    fs = FairShare(max_keys=3, clock=clock)
    keys = [bytes([i]) for i in range(8)]
    for key in keys:
        fs.on_active(key)
        fs.charge(key, decode=1)
        clock.now += 1
        fs.on_idle(key)
    assert len(fs) == 3
    assert [fs.service(k) for k in keys] == [0.0] * 5 + [2.0] * 3


def test_active_keys_are_never_forgotten() -> None:
    fs = FairShare(max_keys=2)
    keys = [bytes([i]) for i in range(5)]
    for key in keys:
        fs.on_active(key)
        fs.charge(key, decode=1)
    assert len(fs) == 5
    assert all(fs.service(k) == 2.0 for k in keys)
    for key in keys[:4]:
        fs.on_idle(key)
    assert len(fs) == 2 and fs.service(keys[4]) == 2.0 and fs.service(keys[3]) == 2.0


def test_idle_keys_expire_after_the_ttl() -> None:
    clock = Clock()
    fs = FairShare(idle_ttl_s=60.0, clock=clock)
    fs.on_active(A)
    fs.on_active(B)
    fs.charge(A, decode=1)
    fs.on_idle(A)
    clock.now += 59.0
    fs.expire()
    assert fs.service(A) == 2.0
    clock.now += 2.0
    fs.expire()
    assert fs.service(A) == 0.0 and len(fs) == 1  # B is active: kept


def test_heap_stays_bounded_under_churn() -> None:
    fs = FairShare(max_keys=16)
    for i in range(20000):
        key = (i % 500).to_bytes(2, "big")
        fs.on_active(key)
        fs.charge(key, decode=1)
        fs.on_idle(key)
    assert len(fs) <= 16
    assert len(fs._heap) <= 65  # rebuilt past 2 x active keys + 64 entries


def test_fifo_mode_preserves_arrival_order() -> None:
    fs = FairShare(policy="fifo")
    for key in (A, B):
        fs.on_active(key)
    fs.charge(A, decode=1000)
    waiting = [Req(A, 0), Req(B, 1), Req(A, 2), Req(B, 3)]
    order = []
    while waiting:
        chosen = fs.pick(waiting)
        assert chosen is not None
        order.append(chosen.arrival)
        waiting.remove(chosen)
        fs.charge(chosen.fkey, prefill_computed=100)
    assert order == [0, 1, 2, 3]
    assert fs.service(A) == 2200.0  # accounting still runs for metrics


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        FairShare(policy="lottery")
    fs = FairShare()
    for weight in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            fs.on_active(A, weight)
    assert len(fs) == 0
