"""Scheduler and engine behaviour on a tiny random-weight Llama (fast, CPU).

Covers continuous batching order, chunked prefill beside running decodes,
preemption under a tiny KV budget (same greedy outputs), immediate capacity
errors, page accounting after finish/abort/preemption mixes, priorities, and
bad input leaving no state behind.
"""

from __future__ import annotations

import random

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.core import Engine, Priority
from worker.engine.debug import pages_idle
from worker.engine.records.request_errors import RequestError
from worker.kvcache.tensors import bytes_per_token
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def make_engine(tiny, pages: int = 512, **kw) -> Engine:
    per_page = bytes_per_token(tiny.config, tiny.dtype) * 16
    return Engine(tiny, EngineConfig(kv_cache_bytes=pages * per_page, **kw))


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 40000) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def drain(engine: Engine, max_steps: int = 5000) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Step until idle; returns tokens per rid and the step index at which each finished."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, int] = {}
    for step in range(max_steps):
        if not engine.has_work():
            return tokens, finished
        for out in engine.step():
            tokens.setdefault(out.rid, []).extend(out.new_tokens)
            if out.finish_reason is not None:
                finished[out.rid] = step
    raise AssertionError("engine did not drain")


def test_short_request_finishes_before_long_one(tiny):
    eng = make_engine(tiny)
    rng = random.Random(1)
    eng.add_request("long", rand_prompt(rng, 50), greedy(120))
    early = sum(len(o.new_tokens) for _ in range(5) for o in eng.step())
    eng.add_request("short", rand_prompt(rng, 10), greedy(5))
    tokens, finished = drain(eng)
    assert finished["short"] < finished["long"]
    assert early + len(tokens["long"]) == 120 and len(tokens["short"]) == 5
    assert pages_idle(eng)


def test_long_prompt_is_chunked_while_streams_keep_decoding(tiny):
    eng = make_engine(tiny, pages=1024, max_num_batched_tokens=256)
    rng = random.Random(2)
    streams = [f"s{i}" for i in range(8)]
    for rid in streams:
        eng.add_request(rid, rand_prompt(rng, 20), greedy(100))
    while any(not eng._seqs[r].in_decode for r in streams):  # all 8 prefilled
        eng.step()
    eng.add_request("big", rand_prompt(rng, 2000), greedy(4))
    prefill_steps = 0
    while not eng._seqs["big"].in_decode:
        outs = {o.rid: o for o in eng.step()}
        prefill_steps += 1
        for rid in streams:  # every running stream gets a token on every step
            assert len(outs[rid].new_tokens) == 1
    assert prefill_steps >= 2000 // (256 - 8)
    drain(eng)
    assert pages_idle(eng)


def test_preemption_keeps_greedy_outputs(tiny):
    rng = random.Random(3)
    prompts = [rand_prompt(rng, rng.randrange(20, 60)) for _ in range(8)]
    lens = [rng.randrange(30, 80) for _ in range(8)]

    def run(engine: Engine) -> dict[str, list[int]]:
        for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
            engine.add_request(f"r{i}", p, greedy(n))
        tokens, _ = drain(engine)
        return tokens

    free = run(make_engine(tiny, pages=512))
    tight = make_engine(tiny, pages=12, max_num_batched_tokens=64)
    constrained = run(tight)
    assert tight.stats().preemptions > 0
    assert constrained == free
    assert pages_idle(tight)


def test_request_larger_than_cache_gets_capacity_error_at_once(tiny):
    eng = make_engine(tiny, pages=8)  # 128 tokens
    with pytest.raises(RequestError) as err:
        eng.add_request("big", list(range(3, 103)), greedy(40))
    assert err.value.code == "capacity"
    with pytest.raises(RequestError) as err:
        eng.add_request("ctx", [5] * 10, greedy(eng.max_context))
    assert err.value.code == "capacity"
    assert not eng.has_work() and pages_idle(eng)
    eng.add_request("ok", list(range(3, 60)), greedy(40))  # still usable
    drain(eng)
    assert pages_idle(eng)


def test_pages_all_free_after_finish_abort_preemption_mix(tiny):
    rng = random.Random(4)
    eng = make_engine(tiny, pages=20, max_num_batched_tokens=96)
    live: list[str] = []
    aborted: set[str] = set()
    outs_seen: dict[str, str] = {}
    for i in range(40):
        rid = f"m{i}"
        eng.add_request(rid, rand_prompt(rng, rng.randrange(5, 90)), greedy(rng.randrange(1, 60)),
                        priority=Priority(rng.randrange(2)))
        live.append(rid)
        for out in eng.step():
            if out.finish_reason:
                outs_seen[out.rid] = out.finish_reason
        if rng.random() < 0.3:
            victim = rng.choice(live)
            if eng.abort(victim):
                aborted.add(victim)
    for rid in drain(eng)[1]:
        assert rid not in outs_seen  # exactly one final output per request
        outs_seen[rid] = "done"
    assert eng.stats().preemptions > 0
    assert pages_idle(eng)
    assert set(outs_seen) == set(live)
    assert aborted and all(outs_seen[r] in ("abort", "done") for r in aborted)
    assert not eng.abort("m0")  # already gone


def test_abort_emits_final_output_and_frees_pages(tiny):
    eng = make_engine(tiny)
    eng.add_request("a", list(range(3, 40)), greedy(50))
    eng.step()
    used = eng.pool.num_used
    assert used > 0
    assert eng.abort("a")
    assert pages_idle(eng)
    outs = eng.step()
    assert [(o.rid, o.finish_reason, o.new_tokens) for o in outs] == [("a", "abort", [])]
    assert not eng.has_work()


def test_interactive_admitted_before_batch(tiny):
    eng = make_engine(tiny, max_num_seqs=1)
    eng.add_request("b", [5] * 8, greedy(3), priority=Priority.BATCH)
    eng.add_request("i", [6] * 8, greedy(3), priority=Priority.INTERACTIVE)
    _, finished = drain(eng)
    assert finished["i"] < finished["b"]


@pytest.mark.parametrize("slots,pages", [(2, 512), (8, 14)])  # out of slots; out of pages
def test_interactive_arrival_preempts_batch_work_which_resumes_unchanged(tiny, slots, pages):
    rng = random.Random(5)
    batch = {f"b{i}": rand_prompt(rng, 60) for i in range(2)}
    alone = make_engine(tiny)
    for rid, p in batch.items():
        alone.add_request(rid, p, greedy(60), priority=Priority.BATCH)
    expected, _ = drain(alone)
    eng = make_engine(tiny, pages=pages, max_num_seqs=slots)
    for rid, p in batch.items():
        eng.add_request(rid, p, greedy(60), priority=Priority.BATCH)
    got: dict[str, list[int]] = {}
    for _ in range(6):  # both batch requests decoding
        for out in eng.step():
            got.setdefault(out.rid, []).extend(out.new_tokens)
    assert all(eng._seqs[r].in_decode for r in batch)
    eng.add_request("i", rand_prompt(rng, 100), greedy(4), priority=Priority.INTERACTIVE)
    before = eng.stats().preemptions
    for out in eng.step():  # the interactive request is admitted at once
        got.setdefault(out.rid, []).extend(out.new_tokens)
    assert eng._seqs["i"].num_computed > 0 and eng.stats().preemptions > before
    tokens, finished = drain(eng)
    for rid, toks in tokens.items():
        got.setdefault(rid, []).extend(toks)
    assert {r: got[r] for r in batch} == expected  # the preempted batch work resumed, same greedy tokens
    assert len(got["i"]) == 4 and finished["i"] < min(finished[r] for r in batch)
    assert pages_idle(eng)


def test_batch_decodes_sit_out_the_step_of_an_interactive_prefill(tiny):
    rng = random.Random(6)
    eng = make_engine(tiny)
    for i in range(3):
        eng.add_request(f"b{i}", rand_prompt(rng, 20), greedy(40), priority=Priority.BATCH)
    while not all(eng._seqs[f"b{i}"].in_decode for i in range(3)):
        eng.step()
    eng.add_request("i", rand_prompt(rng, 30), greedy(3), priority=Priority.INTERACTIVE)
    outs = {o.rid: o for o in eng.step()}  # the interactive prefill's step: no batch token in it
    assert outs["i"].new_tokens and not any(outs[f"b{i}"].new_tokens for i in range(3) if f"b{i}" in outs)
    outs = {o.rid: o for o in eng.step()}  # then everyone decodes again
    assert all(len(outs[f"b{i}"].new_tokens) == 1 for i in range(3))
    tokens, _ = drain(eng)
    assert pages_idle(eng)


@pytest.mark.parametrize("tokens,params,param", [
    ([], greedy(4), "prompt"),
    ([5, 10**7], greedy(4), "prompt"),
    ([5, -1], greedy(4), "prompt"),
    ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
    ([5, 6], SamplingParams(temperature=-0.5), "temperature"),
    ([5, 6], SamplingParams(top_p=0.0), "top_p"),
    ([5, 6], SamplingParams(top_p=1.5), "top_p"),
    ([5, 6], SamplingParams(top_k=-1), "top_k"),
])
def test_bad_input_is_rejected_without_state_change(tiny, tokens, params, param):
    eng = make_engine(tiny)
    before = eng.stats()
    with pytest.raises(RequestError) as err:
        eng.add_request("x", tokens, params)
    assert err.value.code == "bad_request" and err.value.param == param
    assert eng.stats() == before and not eng.has_work() and pages_idle(eng)
    eng.add_request("x", [5, 6], greedy(2))  # the rid was not taken
    with pytest.raises(RequestError) as err:
        eng.add_request("x", [5, 6], greedy(2))
    assert err.value.code == "bad_request" and err.value.param == "rid"
    assert len(drain(eng)[0]["x"]) == 2
    assert len(eng.generate([[7, 8, 9]], greedy(3))[0]) == 3


@pytest.mark.parametrize("cap,per_step", [(0, 8), (64, 1), (100, 2)])
def test_prefill_step_tokens_spreads_a_burst_over_steps(tiny, cap, per_step):
    """Eight requests over a cached 96-token prefix, 48 uncached tokens each, arrive together: with
    `prefill_step_tokens` a step that carries one prefill takes another only within the cap (counting uncached
    tokens), so their first tokens come one step after another, and every request still completes."""
    rng = random.Random(9)
    prefix = rand_prompt(rng, 96)
    prompts = [prefix + rand_prompt(rng, 48) for _ in range(8)]
    eng = make_engine(tiny, prefill_step_tokens=cap)
    eng.add_request("warm", prefix + [5], greedy(1))
    drain(eng)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(6))
    firsts, early = [], {}
    for _ in range(3):
        outs = eng.step()
        firsts.append(sum(1 for o in outs if o.new_tokens and len(eng._seqs[o.rid].tokens) == 145))
        for o in outs:
            early.setdefault(o.rid, []).extend(o.new_tokens)
    tokens, _ = drain(eng)
    assert pages_idle(eng)
    assert firsts[0] == per_step and (per_step == 8 or firsts[1] == per_step)
    assert all(len(early.get(f"r{i}", [])) + len(tokens.get(f"r{i}", [])) == 6 for i in range(8))


def test_prefill_step_tokens_is_auto_on_cpu(tiny):
    from worker.config import CPU_PREFILL_STEP_TOKENS

    assert make_engine(tiny).config.prefill_step_tokens == CPU_PREFILL_STEP_TOKENS
    assert make_engine(tiny, prefill_step_tokens=0).config.prefill_step_tokens == 0
    with pytest.raises(ValueError, match="prefill_step_tokens"):
        make_engine(tiny, prefill_step_tokens=-1)
