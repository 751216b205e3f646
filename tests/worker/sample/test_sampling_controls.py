"""Sampling controls in the batched sampler: top logprobs, logit bias, penalties, min_tokens, 64-bit seeds.

References are computed from the model's own logit rows (captured by `DebugEngine`) with the
published formulas: OpenAI's presence/frequency penalties, HF/vLLM's repetition penalty.
"""

from __future__ import annotations

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.debug import DebugEngine
from worker.engine.records.request_errors import RequestError
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams
from worker.sample.logit_adjust import build_adjust
from worker.sample.sampler import SamplingBatch, sample

PROMPT = [5, 9, 17, 33, 65, 129, 5, 9]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def run(tiny, params: SamplingParams, prompt=PROMPT):
    """(tokens, finish reason, outputs, captured last-row logits per sampling step)."""
    eng = DebugEngine(tiny, EngineConfig(kv_cache_bytes=8 << 20))
    eng.add_request("r", list(prompt), params)
    tokens, outs, rows, finish = [], [], [], None
    while eng.has_work():
        capture: list = []
        step = eng.step(capture=capture)
        rows.append(capture[-1][2][-1].clone())
        for o in step:
            tokens += o.new_tokens
            outs.append(o)
            finish = o.finish_reason or finish
    return tokens, finish, outs, rows


def test_top_logprobs_match_the_model_logits(tiny):
    params = SamplingParams(max_tokens=5, logprobs=True, top_logprobs=5, ignore_eos=True)
    tokens, _, outs, rows = run(tiny, params)
    assert len(tokens) == 5
    for out, row in zip(outs, rows, strict=True):
        ref = torch.log_softmax(row, -1)
        vals, ids = torch.topk(ref, 5)
        assert out.top_ids == [ids.tolist()]
        assert torch.allclose(torch.tensor(out.top_logprobs[0]), vals, atol=1e-5)
        assert out.logprobs[0] == pytest.approx(ref[out.new_tokens[0]].item(), abs=1e-5)


def test_logit_bias_bans_and_forces(tiny):
    base, *_ = run(tiny, SamplingParams(max_tokens=6, ignore_eos=True))
    banned, *_ = run(tiny, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((base[0], -100.0),)))
    assert banned[0] != base[0] and base[0] not in banned
    forced, *_ = run(tiny, SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                          logit_bias=((123, 100.0),)))
    assert forced == [123] * 6


def test_min_tokens_holds_back_eos(tiny):
    eos = tiny.tokenizer.eos_token_id
    params = SamplingParams(max_tokens=10, min_tokens=3, logit_bias=((eos, 100.0),))
    tokens, finish, *_ = run(tiny, params)
    assert len(tokens) == 3 and eos not in tokens and finish == "stop"


def reference_penalized(row: torch.Tensor, prompt: list[int], out: list[int],
                        p: SamplingParams) -> torch.Tensor:
    row = row.clone()
    for t in set(prompt + out):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


@pytest.mark.parametrize("kw", [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
                                {"repetition_penalty": 1.8}, {"repetition_penalty": 0.8}])
def test_penalties_match_the_reference_formula(tiny, kw):
    # The tiny random model never repeats by itself; penalties below neutral make it.
    repeat = {"presence_penalty": -1.0, "repetition_penalty": 0.5}
    base, *_ = run(tiny, SamplingParams(max_tokens=24, ignore_eos=True, **repeat))
    assert len(set(base)) < len(base)
    params = SamplingParams(max_tokens=24, ignore_eos=True, **{**repeat, **kw})
    tokens, _, _, rows = run(tiny, params)
    assert tokens != base
    for i, row in enumerate(rows):
        ref = reference_penalized(row, PROMPT, tokens[:i], params)
        assert int(ref.argmax()) == tokens[i]


def test_penalty_rows_apply_exactly():
    class Seq:  # the fields build_adjust reads
        def __init__(self, tokens, prompt_len, sampling):
            self.tokens, self.prompt_len, self.sampling = tokens, prompt_len, sampling
            self.stop_ids = frozenset()

        @property
        def num_output(self):
            return len(self.tokens) - self.prompt_len

    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    seqs = [Seq([1, 2, 3, 3, 4, 4, 4], 3, p), Seq([7], 1, SamplingParams())]
    logits = torch.randn(2, 10)
    adjusted = build_adjust(seqs, 10, torch.device("cpu")).apply(logits)
    assert torch.allclose(adjusted[0], reference_penalized(logits[0], [1, 2, 3], [3, 4, 4, 4], p))
    assert torch.equal(adjusted[1], logits[1])
    assert build_adjust([Seq([7], 1, SamplingParams())], 10, torch.device("cpu")) is None


def test_top_logprobs_in_the_sampler_are_the_raw_distribution():
    logits = torch.randn(3, 40)
    b = SamplingBatch(torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.arange(3),
                      torch.zeros(3, dtype=torch.int64), False, False, False, True, top_logprobs=4)
    out = sample(logits, b)
    vals, ids = torch.topk(torch.log_softmax(logits, -1), 4)
    assert torch.equal(out.top_ids, ids) and torch.allclose(out.top_logprobs, vals)


def test_seed_uses_all_64_bits(tiny):
    def draw(seed):
        return run(tiny, SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True))[0]
    assert draw(5) == draw(5)
    assert draw(5) != draw(5 + (1 << 40))
    assert len(draw(2**64 - 1)) == 8 and len(draw(-(2**63))) == 8


def test_wire_round_trip_and_validation():
    p = SamplingParams(max_tokens=9, top_logprobs=3, presence_penalty=0.5, frequency_penalty=-1,
                       repetition_penalty=1.1, min_tokens=2, logit_bias=((4, -100.0), (7, 2.5)),
                       seed=2**64 - 1)
    assert SamplingParams.from_dict(p.to_dict()) == p
    for bad, param in [({"top_logprobs": 21}, "top_logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 99}, "min_tokens"),
                       ({"logit_bias": ((50, 1.0),)}, "logit_bias"),
                       ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"seed": 2**64}, "seed")]:
        with pytest.raises(RequestError) as err:
            SamplingParams(**bad).validate(50)
        assert err.value.param == param


def test_top_logprobs_travel_packed_in_out_frames():
    from worker.protocol import OutItem, decode_worker_frame, encode_out

    items = [OutItem("a", [1, 2], None, 0, [-0.5, -1.0], top_ids=[[1, 3, 4], [2, 5, 6]],
                     top_logprobs=[[-0.5, -1.5, -2.0], [-1.0, -1.25, -3.0]]),
             OutItem("b", [7], "stop", 3, None)]
    frame = decode_worker_frame(encode_out(items, 1.0))
    assert frame.items[0].top_ids == [[1, 3, 4], [2, 5, 6]]
    assert frame.items[0].top_logprobs == [[-0.5, -1.5, -2.0], [-1.0, -1.25, -3.0]]
    assert frame.items[1].top_ids is None and frame.items[1].tokens == [7]


def test_top_k_past_int64_is_refused_and_the_worker_keeps_serving():
    """A top_k of 2^63 once threw inside the step and ended every request on the worker."""
    from worker.config import EngineConfig
    from worker.engine.core import Engine
    from worker.engine.records.request_errors import RequestError
    from worker.model.tiny_model import load_tiny_model

    eng = Engine(load_tiny_model(dtype="float32", device="cpu"), EngineConfig(kv_cache_bytes=16 << 20))
    try:
        with pytest.raises(RequestError) as err:
            eng.add_request("huge", [1, 2, 3], SamplingParams(max_tokens=4, temperature=1.0, top_k=2**63))
        assert err.value.param == "top_k"
        big = SamplingParams(max_tokens=4, temperature=1.0, top_k=2**31 - 1, seed=1, ignore_eos=True)
        assert len(eng.generate([[1, 2, 3]], big)[0]) == 4  # the largest allowed k keeps every token
    finally:
        eng.close()
