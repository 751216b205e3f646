"""VTC fair share inside a real engine (tiny random-weight Llama, CPU): admission order between keys,
greedy outputs unchanged by the policy, key-based preemption victims, weighted service, input checks.
"""

from __future__ import annotations

import random

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.debug import pages_idle
from worker.engine.records.request_errors import RequestError
from worker.kvcache.tensors import bytes_per_token
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams

A, B = b"tenant-a", b"tenant-b"


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def make_engine(tiny, fairness: str, pages: int = 512, **kw) -> Engine:
    per_page = bytes_per_token(tiny.config, tiny.dtype) * 16
    return Engine(tiny, EngineConfig(kv_cache_bytes=pages * per_page, fairness=fairness, **kw))


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 40000) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def drain(engine: Engine, max_steps: int = 5000) -> tuple[dict[str, list[int]], list[str]]:
    """Step until idle; tokens per rid and the order in which requests produced their first token."""
    tokens: dict[str, list[int]] = {}
    first: list[str] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return tokens, first
        for out in engine.step():
            if out.rid not in tokens:
                first.append(out.rid)
            tokens.setdefault(out.rid, []).extend(out.new_tokens)
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("policy", ["vtc", "fifo"])
def test_light_key_jumps_a_flooding_key_under_vtc_only(tiny, policy):
    eng = make_engine(tiny, policy, max_num_seqs=4)
    rng = random.Random(1)
    for i in range(20):
        eng.add_request(f"a{i}", prompt(rng, 20), greedy(8), fkey=A)
    eng.step()
    eng.step()  # a0-a3 run and are charged; every slot is taken
    eng.add_request("b", prompt(rng, 20), greedy(8), fkey=B)
    _, first = drain(eng)
    if policy == "vtc":
        assert first.index("b") <= 4  # b takes a slot from a at once (fair-share preemption)
        assert eng.stats().preemptions == 1
    else:
        assert first.index("b") == 20  # behind all of a's queue
    assert len(eng.scheduler.fair) == 2 and eng.scheduler.fair.active_keys == 0
    assert pages_idle(eng)


def test_greedy_outputs_are_the_same_under_vtc_fifo_and_alone(tiny):
    rng = random.Random(2)
    reqs = [(f"r{i}", prompt(rng, rng.randrange(5, 60)), rng.randrange(4, 40), (A, B, b"c")[i % 3],
             1.0 + i % 2)
            for i in range(12)]
    results = {}
    for policy in ("vtc", "fifo"):
        eng = make_engine(tiny, policy, pages=14, max_num_seqs=6)  # small KV: preemptions happen
        for rid, p, n, key, w in reqs:
            eng.add_request(rid, p, greedy(n), fkey=key, weight=w)
        results[policy], _ = drain(eng)
        assert eng.stats().preemptions > 0
        assert pages_idle(eng)
    alone_eng = make_engine(tiny, "vtc")
    alone = {rid: alone_eng.generate([p], greedy(n))[0] for rid, p, n, _, _ in reqs}
    assert results["vtc"] == results["fifo"] == alone


@pytest.mark.parametrize("policy", ["vtc", "fifo"])
def test_preemption_takes_the_newest_sequence_of_the_key_most_over_its_share(tiny, policy):
    eng = make_engine(tiny, policy, pages=10, max_num_seqs=8)
    rng = random.Random(3)
    for rid in ("a1", "a2"):
        eng.add_request(rid, prompt(rng, 16), greedy(60), fkey=A)
    early = {"a1": 0, "a2": 0}
    for _ in range(10):
        for out in eng.step():
            early[out.rid] += len(out.new_tokens)
    eng.add_request("b", prompt(rng, 16), greedy(60), fkey=B)  # the newest sequence, on the lower counter
    seqs = dict(eng._seqs)
    tokens, _ = drain(eng)
    assert {rid: early.get(rid, 0) + len(t) for rid, t in tokens.items()} == {"a1": 60, "a2": 60, "b": 60}
    assert eng.stats().preemptions > 0
    if policy == "vtc":
        assert seqs["b"].admissions == 1 and seqs["a2"].admissions > 1
    else:
        assert seqs["b"].admissions > 1
    assert pages_idle(eng)


def test_weight_two_key_gets_twice_the_service_when_both_are_backlogged(tiny):
    eng = make_engine(tiny, "vtc", max_num_seqs=4)
    rng = random.Random(4)
    for i in range(150):  # interleaved arrivals: FIFO would split the service evenly
        eng.add_request(f"h{i}", prompt(rng, 8), greedy(16), fkey=A, weight=2.0)
        eng.add_request(f"l{i}", prompt(rng, 8), greedy(16), fkey=B, weight=1.0)
    for _ in range(600):
        eng.step()
    fair = eng.scheduler.fair
    assert fair.active_requests(A) > 4 and fair.active_requests(B) > 4  # both still backlogged
    assert fair.service(A) / fair.service(B) == pytest.approx(2.0, rel=0.1)


@pytest.mark.parametrize(("fkey", "weight", "param"), [
    (b"x" * 65, 1.0, "fkey"), ("str-key", 1.0, "fkey"), (A, 0.0, "weight"), (A, float("nan"), "weight"),
    (A, True, "weight"), (A, 1001.0, "weight"), (A, "2", "weight"),
])
def test_bad_fairness_fields_are_refused_without_state(tiny, fkey, weight, param):
    eng = make_engine(tiny, "vtc")
    with pytest.raises(RequestError) as err:
        eng.add_request("r", [5, 6, 7], greedy(2), fkey=fkey, weight=weight)
    assert err.value.param == param
    assert not eng.has_work() and len(eng.scheduler.fair) == 0
