"""Fair share of running slots: `FairShare.slot_victim`/`under_share` rules, and the scheduler's fairness
preemption in a real engine (tiny random-weight Llama, CPU): a light key gets a slot held by a flooding key,
without thrash, with greedy outputs unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from tests.worker.engine.test_engine_fairness import greedy, make_engine, prompt
from worker.engine.core import Engine
from worker.engine.debug import pages_idle
from worker.engine.scheduling.fairness import FairShare
from worker.model.tiny_model import load_tiny_model

A, B, C = b"tenant-a", b"tenant-b", b"tenant-c"


def share(*keys: tuple[bytes, float, float]) -> FairShare:
    """Active keys with (weight, counter)."""
    fs = FairShare()
    for key, weight, _ in keys:
        fs.on_active(key, weight)
    for key, _, counter in keys:
        fs._keys[key].counter = counter
    return fs


def test_slot_victim_needs_the_head_under_and_the_victim_over_its_share_and_a_gap() -> None:
    fs = share((A, 1.0, 100.0), (B, 1.0, 0.0))
    assert fs.slot_victim(B, {A: 8}, 8, gap=32) == A
    assert fs.slot_victim(B, {A: 4, B: 3}, 8, gap=32) is None  # B would pass its share of 4
    assert fs.slot_victim(B, {A: 4, B: 2}, 8, gap=32) is None  # A would drop below its share
    assert fs.slot_victim(B, {A: 5, B: 2}, 8, gap=32) == A
    assert fs.slot_victim(B, {A: 8}, 8, gap=101) is None  # the gap (A must be at least B + gap)
    assert fs.slot_victim(A, {B: 8}, 8, gap=0) is None  # B is below A: never the victim
    fs._keys[B].counter = 100.0
    assert fs.slot_victim(B, {A: 8}, 8, gap=0) == A  # equal counters (a just-lifted key): A gives a slot
    assert fs.under_share(B, 3, 8) and not fs.under_share(B, 4, 8)


def test_slot_shares_follow_weights_and_the_highest_counter_is_the_victim() -> None:
    fs = share((A, 2.0, 300.0), (B, 1.0, 200.0), (C, 1.0, 0.0))
    # shares of 8 slots: A 4, B 2, C 2
    assert fs.slot_victim(C, {A: 5, B: 3}, 8, gap=0) == A
    assert fs.slot_victim(C, {A: 4, B: 3}, 8, gap=0) == B  # A at its share: B, over, is next
    assert fs.slot_victim(C, {A: 4, B: 2, C: 2}, 8, gap=0) is None
    fifo = FairShare("fifo")
    fifo.on_active(A)
    fifo.on_active(B)
    assert fifo.slot_victim(B, {A: 8}, 8, gap=0) is None and not fifo.under_share(B, 0, 8)


def test_active_weight_follows_activation_and_weight_changes() -> None:
    fs = FairShare()
    fs.on_active(A, 2.0)
    fs.on_active(A, 3.0)  # a later request with a new weight
    fs.on_active(B, 1.0)
    assert fs._active_weight == 4.0
    fs.on_idle(A)
    fs.on_idle(A)
    assert fs._active_weight == 1.0
    fs.on_idle(B)
    assert fs._active_weight == 0.0


def run(eng: Engine, a_reqs, b_reqs, b_every: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    """A's requests all at once; one of B's every `b_every` steps. Tokens per rid, and B's wait in steps."""
    for rid, p, n in a_reqs:
        eng.add_request(rid, p, greedy(n), fkey=A)
    tokens: dict[str, list[int]] = {}
    added: dict[str, int] = {}
    waits: dict[str, int] = {}
    pending = list(b_reqs)
    for step in range(5000):
        if pending and step % b_every == 0:
            rid, p, n = pending.pop(0)
            eng.add_request(rid, p, greedy(n), fkey=B)
            added[rid] = step
        if not eng.has_work() and not pending:
            return tokens, waits
        for out in eng.step():
            if out.rid not in tokens and out.rid in added:
                waits[out.rid] = step - added[out.rid]
            tokens.setdefault(out.rid, []).extend(out.new_tokens)
    raise AssertionError("engine did not drain")


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def test_light_key_takes_a_slot_from_a_flooding_key_without_thrash_and_same_greedy_tokens(tiny):
    rng = random.Random(7)
    a_reqs = [(f"a{i}", prompt(rng, rng.randrange(20, 60)), 30) for i in range(24)]
    b_reqs = [(f"b{i}", prompt(rng, 12), 6) for i in range(6)]
    results, waits, preempt = {}, {}, {}
    for policy in ("vtc", "fifo"):
        eng = make_engine(tiny, policy, max_num_seqs=4, max_num_batched_tokens=64)
        results[policy], waits[policy] = run(eng, a_reqs, b_reqs, b_every=12)
        preempt[policy] = eng.stats().preemptions
        assert pages_idle(eng)
    # every b gets its first token at most one step after it arrives (preemption, then its own step)
    assert max(waits["vtc"].values()) <= 1
    assert max(waits["fifo"].values()) > 20  # behind the flood
    assert 0 < preempt["vtc"] <= len(b_reqs) and preempt["fifo"] == 0  # at most one preemption per b
    alone = make_engine(tiny, "vtc")
    want = {rid: alone.generate([p], greedy(n))[0] for rid, p, n in a_reqs + b_reqs}
    assert results["vtc"] == results["fifo"] == want


def test_a_light_keys_prefill_step_carries_no_other_prefill_chunk(tiny):
    eng = make_engine(tiny, "vtc", max_num_seqs=8, max_num_batched_tokens=64)
    rng = random.Random(8)
    for i in range(6):
        eng.add_request(f"a{i}", prompt(rng, 200), greedy(4), fkey=A)
    eng.step()  # a0 prefills its first chunk
    eng.add_request("b", prompt(rng, 10), greedy(4), fkey=B)
    batch = eng.scheduler.schedule()
    assert [s.fkey for s, _ in batch.prefills] == [B]


def test_shared_step_cap_applies_only_under_vtc_once_a_second_key_was_seen(tiny):
    rng = random.Random(9)
    for policy, cap_seen in (("vtc", 24), ("fifo", 64)):
        eng = make_engine(tiny, policy, max_num_seqs=8, max_num_batched_tokens=64, fair_step_tokens=24)
        eng.add_request("a0", prompt(rng, 200), greedy(2), fkey=A)
        assert eng.scheduler._shared_step_cap() == 64  # one key: full steps
        eng.add_request("b0", prompt(rng, 4), greedy(1), fkey=B)
        for _ in range(40):
            if eng.scheduler.fair.active_requests(B) == 0:
                break  # b0 done: B is idle
            eng.step()
        assert eng.scheduler.fair.active_requests(B) == 0
        # B is idle but still tracked: the worker is shared, so A's prefill chunks stay short under VTC
        eng.add_request("a1", prompt(rng, 200), greedy(2), fkey=A)
        assert eng.scheduler._shared_step_cap() == cap_seen, policy
        batch = eng.scheduler.schedule()
        full = 64 - len(batch.decodes)  # decodes come out of the step's budget first
        assert sum(n for _, n in batch.prefills) == min(cap_seen, full), policy
        eng.close()


def test_a_light_keys_prefill_runs_alone_while_a_key_floods_and_never_twice_in_a_row(tiny):
    """A flood (A over its share of the slots): B's first prefill is a step of its own, without A's decodes,
    so B's first token waits only for the step in flight; C arriving right after waits one step for A's
    decodes to run (never two prefill-only steps in a row). Without a flood, a light prefill rides with
    decodes."""
    eng = make_engine(tiny, "vtc", max_num_seqs=4, max_num_batched_tokens=256)
    rng = random.Random(10)
    for i in range(6):
        eng.add_request(f"a{i}", prompt(rng, 20), greedy(40), fkey=A)
    for _ in range(3):
        eng.step()  # A's four slots decode
    assert len(eng.scheduler.running) == 4
    eng.add_request("b", prompt(rng, 10), greedy(4), fkey=B)
    eng.add_request("c", prompt(rng, 10), greedy(4), fkey=C)
    batches = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: batches.append(schedule()) or batches[-1]  # type: ignore[method-assign]
    eng.step()  # preempts one of A's (fair share), then B alone
    assert [s.fkey for s,
            _ in batches[0].prefills] == [B] and not batches[0].decodes and not batches[0].verifies
    eng.step()
    assert batches[1].decodes, "decodes run at least every other step"
    assert [s.fkey for s, _ in batches[1].prefills] == [C]  # C rides with them

    calm = make_engine(tiny, "vtc", max_num_seqs=8, max_num_batched_tokens=256)
    calm.add_request("a0", prompt(rng, 20), greedy(40), fkey=A)
    calm.step()
    calm.add_request("b", prompt(rng, 10), greedy(4), fkey=B)
    batch = calm.scheduler.schedule()  # A runs 1 of its 4 slots: no flood, B's prefill rides with A's decode
    assert [s.fkey for s, _ in batch.prefills] == [B] and [s.fkey for s in batch.decodes] == [A]


def test_a_key_under_its_share_with_a_request_running_also_prefills_alone(tiny):
    """B already runs one request (under its share of 4 of 8 slots) while A floods: B's next request still
    gets a prefill step of its own (a light key is one under its share, not only one with nothing running)."""
    eng = make_engine(tiny, "vtc", max_num_seqs=8, max_num_batched_tokens=512)
    rng = random.Random(11)
    eng.add_request("b1", prompt(rng, 10), greedy(60), fkey=B)
    for i in range(10):
        eng.add_request(f"a{i}", prompt(rng, 20), greedy(60), fkey=A)
    for _ in range(4):
        eng.step()
    running = [s.fkey for s in eng.scheduler.running]
    assert running.count(B) == 1 and running.count(A) == 7
    batches = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: batches.append(schedule()) or batches[-1]  # type: ignore[method-assign]
    eng.add_request("b2", prompt(rng, 10), greedy(4), fkey=B)
    eng.step()
    assert [s.rid for s, _ in batches[0].prefills] == ["b2"] and not batches[0].decodes
