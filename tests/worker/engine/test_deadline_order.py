"""The waiting order and TTFT deadlines: among a key's interactive requests the earliest deadline goes first,
within the key's fair share (another key's earlier deadline does not jump the fairest key); batch requests
and requests without a deadline keep arrival order. The engine reports its measured step costs."""

from __future__ import annotations

import pytest
import torch

from common.priorities import Priority
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.records.sequence import Sequence
from worker.engine.scheduling.fairness import FairShare
from worker.engine.scheduling.waiting_order import CACHE_AWARE_MAX_SKIPS, deadline_index, fair_head
from worker.kvcache.tensors import bytes_per_token
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams

A, B = b"tenant-a", b"tenant-b"
INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


def seq(rid: str, arrival: int, fkey: bytes = A, ttft: float = 0.0,
        priority: Priority = INTERACTIVE) -> Sequence:
    return Sequence(rid, [5, 6, 7, 8], 4, SamplingParams(max_tokens=2), priority, arrival, b"ns", 0,
                    frozenset(), fkey=fkey, ttft_deadline=ttft)


def fair_with(*keys: bytes) -> FairShare:
    fs = FairShare()
    for k in keys:
        fs.on_active(k)
    return fs


def test_earliest_deadline_first_within_one_key_and_undated_last():
    waiting = [seq("old", 0), seq("late", 1, ttft=200.0), seq("soon", 2, ttft=100.0)]
    fair = fair_with(A)
    head = fair_head(waiting, fair)
    assert head == 0
    assert waiting[deadline_index(waiting, head, fair)].rid == "soon"
    waiting.pop(2)
    assert waiting[deadline_index(waiting, head, fair)].rid == "late"
    waiting.pop(1)
    assert deadline_index(waiting, head, fair) is None  # no deadline left: arrival order


def test_deadlines_reorder_only_inside_the_fairest_keys_share():
    fair = fair_with(A, B)
    fair.charge(B, prefill_computed=1000)  # B has had more service: A is the fairest key
    waiting = [seq("b-urgent", 0, B, ttft=1.0), seq("a-old", 1, A), seq("a-due", 2, A, ttft=500.0)]
    head = fair_head(waiting, fair)
    assert waiting[head].rid == "a-old"
    assert waiting[deadline_index(waiting, head, fair)].rid == "a-due"  # not B's earlier deadline


def test_batch_requests_and_an_overtaken_head_keep_arrival_order():
    fair = fair_with(A)
    batch = [seq("b0", 0, priority=BATCH), seq("b1", 1, ttft=1.0, priority=BATCH)]
    assert deadline_index(batch, 0, fair) is None
    waiting = [seq("head", 0), seq("due", 1, ttft=1.0)]
    waiting[0].skipped = CACHE_AWARE_MAX_SKIPS
    assert deadline_index(waiting, 0, fair) is None


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def test_engine_admits_by_deadline_and_reports_step_costs(tiny):
    per_page = bytes_per_token(tiny.config, tiny.dtype) * 16
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=256 * per_page, max_num_seqs=1))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, (rid, ttft) in enumerate([("none", 0.0), ("late", 2e9), ("soon", 1e9)]):
        eng.add_request(rid, [10 + i] * 40, params, fkey=A, ttft=ttft)
    assert eng.stats().prefill_backlog == 120 and eng.stats().step_s == 0.0
    first: list[str] = []
    for _ in range(100):
        if not eng.has_work():
            break
        first += [o.rid for o in eng.step() if o.new_tokens and o.rid not in first]
    assert first == ["soon", "late", "none"]
    stats = eng.stats()
    assert stats.prefill_tps > 0 and stats.step_s > 0 and stats.prefill_backlog == 0
