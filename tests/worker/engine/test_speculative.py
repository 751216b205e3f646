"""N-gram speculative decoding: exact greedy and seeded outputs on vs off (batching, chunked prefill,
preemption, prefix-cache hits), stop rules inside an accepted run, pages freed, the sampling distribution
kept, the opt-outs.

Most tests swap a sequence's n-gram index for an oracle that drafts the reference output with planted errors,
so every path (all accepted, partly accepted, rejected at once) runs many times on the tiny random model.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.debug import pages_idle
from worker.engine.records.sequence import NgramIndex
from worker.kvcache.tensors import bytes_per_token
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def make_engine(tiny, pages: int = 512, spec: bool = True, **kw) -> Engine:
    per_page = bytes_per_token(tiny.config, tiny.dtype) * 16
    kw.setdefault("spec_max_batch", 64)
    return Engine(tiny, EngineConfig(kv_cache_bytes=pages * per_page, spec_tokens=4 if spec else 0, **kw))


class Oracle:
    """Drafts the reference continuation, each token wrong with probability `miss` (a stand-in n-gram
    index)."""

    def __init__(self, prompt_len: int, reference: list[int], miss: float, seed: int) -> None:
        self.prompt_len, self.ref, self.miss, self.rng = prompt_len, reference, miss, random.Random(seed)
        self.calls = 0

    def record(self, accepted: int) -> None:
        pass  # no backoff: every step drafts

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.calls += 1
        i = len(tokens) - self.prompt_len
        out = list(self.ref[i:i + k])
        for j in range(len(out)):
            if self.rng.random() < self.miss:
                out[j] = (out[j] + 1 + self.rng.randrange(100)) % 49152
        return out


def run(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]], oracle: dict | None = None,
        waves: int = 1, miss: float = 0.3) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Add requests in `waves` (one wave per few steps), step to idle; tokens and finish reason per rid."""
    tokens: dict[str, list[int]] = {r: [] for r in reqs}
    reasons: dict[str, str] = {}
    items = list(reqs.items())
    per_wave = -(-len(items) // waves)
    for step in range(20000):
        if step % 3 == 0 and items:
            for rid, (prompt, sp) in items[:per_wave]:
                engine.add_request(rid, prompt, sp)
                if oracle is not None:
                    engine._seqs[rid].ngram = Oracle(len(prompt), oracle[rid], miss, hash(rid) & 0xFFFF)
            items = items[per_wave:]
        if not items and not engine.has_work():
            return tokens, reasons
        for out in engine.step():
            tokens[out.rid].extend(out.new_tokens)
            if out.finish_reason is not None:
                reasons[out.rid] = out.finish_reason
    raise AssertionError("engine did not drain")


def workload(seed: int, n: int, lo: int = 5, hi: int = 120, shared: list[int] | None = None,
             **sp) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        prompt = (shared or []) + [rng.randrange(3, 40000) for _ in range(rng.randrange(lo, hi))]
        out[f"q{i}"] = (prompt, SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True, **sp))
    return out


def check_exact(tiny, reqs, waves: int = 1, miss: float = 0.3, **kw) -> Engine:
    ref, ref_reasons = run(make_engine(tiny, spec=False, **kw), reqs, waves=waves)
    eng = make_engine(tiny, **kw)
    got, reasons = run(eng, reqs, oracle=ref, waves=waves, miss=miss)
    assert got == ref and reasons == ref_reasons
    assert pages_idle(eng) and eng.pool.num_free + eng.stats().cached_pages == eng.pool.num_pages
    s = eng.stats()
    assert s.spec_verify_steps > 0 and 0 < s.spec_accepted_tokens < s.spec_proposed_tokens
    return eng


def test_ngram_index_proposes_latest_longest_match():
    idx = NgramIndex(1, 3)
    toks = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    assert idx.propose(toks, 3) == [2, 3, 6]  # "6 7" last seen before "2 3"
    toks += [8]  # "6 7 8" (trigram) only at the start
    assert idx.propose(toks, 2) == [9, 1]
    assert NgramIndex(2, 3).propose([1, 2, 3], 2) == []  # no earlier bigram
    assert len(idx.table) <= 3 * len(toks)
    idx.record(0)
    idx.record(0)  # two misses in a row: four steps without drafts, then drafts again
    assert [idx.propose(toks, 2) for _ in range(5)] == [[], [], [], [], [9, 1]]
    idx.record(0)
    idx.record(2)  # a hit resets the backoff
    assert idx.skip == 0 and idx.misses == 0


def test_greedy_exact_under_continuous_batching(tiny):
    eng = check_exact(tiny, workload(1, 24), waves=4)
    assert eng.stats().spec_tokens_per_step > 1.5


def test_greedy_exact_with_chunked_prefill(tiny):
    reqs = workload(2, 10, lo=100, hi=400)
    check_exact(tiny, reqs, waves=3, max_num_batched_tokens=48)


def test_greedy_exact_under_preemption(tiny):
    rng = random.Random(3)
    reqs = {f"p{i}": ([rng.randrange(3, 40000) for _ in range(rng.randrange(20, 60))],
                      SamplingParams(max_tokens=rng.randrange(30, 80), ignore_eos=True)) for i in range(8)}
    eng = check_exact(tiny, reqs, pages=12, max_num_batched_tokens=64)
    assert eng.stats().preemptions > 0


def test_greedy_exact_with_prefix_cache_hits(tiny):
    shared = [random.Random(9).randrange(3, 40000) for _ in range(70)]
    eng = check_exact(tiny, workload(4, 12, lo=3, hi=30, shared=shared), waves=4)
    assert eng.stats().cached_tokens >= 64 * 6


def test_real_ngram_drafts_stay_exact(tiny):
    """The production index on prompts that repeat themselves (few drafts are right on a random model)."""
    rng = random.Random(5)
    reqs = {}
    for i in range(6):
        span = [rng.randrange(3, 500) for _ in range(12)]
        reqs[f"r{i}"] = (span * 4 + span[:i + 1], SamplingParams(max_tokens=30, ignore_eos=True))
    ref, _ = run(make_engine(tiny, spec=False), reqs)
    eng = make_engine(tiny)
    got, _ = run(eng, reqs)
    assert got == ref and pages_idle(eng) and eng.stats().spec_proposed_tokens > 0


def test_stop_id_and_max_tokens_cut_inside_an_accepted_run(tiny):
    prompt = [random.Random(6).randrange(3, 40000) for _ in range(40)]
    ref, _ = run(make_engine(tiny, spec=False),
                 {"a": (prompt, SamplingParams(max_tokens=40, ignore_eos=True))})
    out = ref["a"]
    i = next(j for j in range(5, 40) if out[j] not in out[:j])  # a token first produced at index i
    cases = {"stop": (SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(out[i],)), out[:i],
                      "stop"),
             "len": (SamplingParams(max_tokens=i + 1, ignore_eos=True), out[:i + 1], "length")}
    for name, (sp, want, reason) in cases.items():
        eng = make_engine(tiny)
        got, reasons = run(eng, {name: (prompt, sp)}, oracle={name: out}, miss=0.0)
        assert got[name] == want and reasons[name] == reason
        assert eng.stats().spec_accepted_tokens > 0 and pages_idle(eng)


def test_seeded_sampling_identical_on_and_off(tiny):
    reqs = workload(7, 16, temperature=0.9)
    for i, (_, sp) in enumerate(reqs.values()):
        sp.seed = 1000 + i
    ref, _ = run(make_engine(tiny, spec=False), reqs)
    eng = make_engine(tiny)
    got, _ = run(eng, reqs, oracle=ref, miss=0.3)
    assert got == ref and eng.stats().spec_accepted_tokens > 0


def test_sampling_distribution_is_the_models(tiny):
    """Fixed drafts (the likeliest next tokens); over many seeds, the verified output positions must follow
    the model's own distribution: chi-square over the likely tokens, and the drafts' own frequencies.

    The first output token comes from the prefill; drafts cover output positions 1 and 2."""
    prompt = [random.Random(1).randrange(3, 40000) for _ in range(12)]
    temp = 0.4
    p0 = _next_probs(tiny, prompt, temp)
    g0 = int(p0.argmax())
    p1 = _next_probs(tiny, prompt + [g0], temp)
    d1 = int(p1.argmax())
    p2 = _next_probs(tiny, prompt + [g0, d1], temp)
    d2 = int(p2.argmax())
    n = 600
    reqs = {f"s{i}": (prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=temp, seed=i))
            for i in range(n)}
    eng = make_engine(tiny)
    got, _ = run(eng, reqs, oracle={rid: [g0, d1, d2] for rid in reqs}, miss=0.0)
    assert eng.stats().spec_verify_steps >= n
    seconds = [t[1] for t in got.values() if t[0] == g0]
    thirds = [t[2] for t in got.values() if t[:2] == [g0, d1]]
    assert len(seconds) > 180 and len(thirds) > 80
    assert _chi2_ok(seconds, p1) and _chi2_ok(thirds, p2)
    for samples, p, d in ((seconds, p1, d1), (thirds, p2, d2)):
        q = p[d].item()
        assert abs(samples.count(d) / len(samples) - q) < 4 * math.sqrt(q * (1 - q) / len(samples))


def _next_probs(tiny, prompt: list[int], temp: float) -> torch.Tensor:
    from worker.engine.debug import DebugEngine

    eng = DebugEngine(tiny, EngineConfig(kv_cache_bytes=8 << 20, spec_tokens=0))
    eng.add_request("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    cap: list = []
    while eng.has_work():
        eng.step(capture=cap)
    logits = next(lg for rid, pos, lg in cap if pos + lg.shape[0] == len(prompt))[-1]
    return torch.softmax(logits / temp, dim=-1)


# 0.999 quantiles, 1..8 degrees of freedom
CHI2_999 = (10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12)


def _chi2_ok(samples: list[int], probs: torch.Tensor) -> bool:
    """Pearson chi-square over the tokens expected at least 5 times (up to 8) plus 'other', at the 0.001
    level."""
    n = len(samples)
    top = [t for t in torch.topk(probs, 8).indices.tolist() if probs[t].item() * n >= 5]
    expected = [probs[t].item() * n for t in top]
    expected.append(n - sum(expected))
    observed = [samples.count(t) for t in top]
    observed.append(n - sum(observed))
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    return stat < CHI2_999[len(top) - 1]


def test_ineligible_requests_decode_plainly_and_still_work(tiny):
    prompt = [7, 8, 9, 10] * 10
    eng = make_engine(tiny)
    cases = {"lp": SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2),
             "pen": SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
             "bias": SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=((7, 5.0),)),
             "off": SamplingParams(max_tokens=8, ignore_eos=True, speculative=False)}
    for rid, sp in cases.items():
        eng.add_request(rid, prompt, sp)
        assert eng._seqs[rid].ngram is None
    eng.add_request("min", prompt, SamplingParams(max_tokens=8, min_tokens=8))
    assert eng._seqs["min"].ngram is not None  # drafts start once min_tokens is reached: never here
    outs: dict[str, list] = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.rid, []).append(o)
    s = eng.stats()
    assert s.spec_proposed_tokens == 0 and pages_idle(eng)
    assert sum(len(o.logprobs or []) for o in outs["lp"]) == 8
    assert all(o.top_ids is not None for o in outs["lp"])
    assert sum(len(o.new_tokens) for o in outs["min"]) == 8
    ref = make_engine(tiny, spec=False).generate([prompt], cases["bias"])[0]
    assert [t for o in outs["bias"] for t in o.new_tokens] == ref


def test_speculation_off_above_the_batch_threshold(tiny):
    for n, expect in ((2, True), (3, False)):
        eng = make_engine(tiny, spec_max_batch=2)
        reqs = {f"t{i}": ([11, 12, 13, 14], SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(n)}
        run(eng, reqs, oracle={rid: [5] * 12 for rid in reqs})
        assert (eng.stats().spec_proposed_tokens > 0) == expect


def test_speculative_field_on_the_wire():
    sp = SamplingParams(speculative=False)
    assert sp.to_dict()["speculative"] is False and "speculative" not in SamplingParams().to_dict()
    assert SamplingParams.from_dict(sp.to_dict()).speculative is False
    from worker.engine.records.request_errors import RequestError

    with pytest.raises(RequestError) as info:
        SamplingParams.from_dict({"speculative": "no"})
    assert info.value.param == "speculative"
    from gateway.openai.schemas import parse_chat

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body).speculative and not parse_chat({**body, "speculative": False}).speculative


def test_bad_spec_config_is_refused():
    with pytest.raises(ValueError, match="n-gram"):
        EngineConfig(spec_ngram_min=3, spec_ngram_max=2).validate()
    with pytest.raises(ValueError, match="spec_tokens"):
        EngineConfig(spec_tokens=17).validate()


@pytest.mark.heavy  # quality gate / default-model end to end: `make test-heavy`, its own CI step
def test_default_model_copies_a_passage_exactly_with_fewer_steps():
    """SmolLM2 (the serving dtype) on a copy task: same greedy text on and off, most drafts accepted."""
    from bench.spec_decode import prompts
    from worker.model.loader import load_model

    loaded = load_model("default", device="cpu")
    prompt = prompts(loaded, 1)[0]
    got = {}
    for on in (False, True):
        eng = Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20, spec_tokens=4 if on else 0))
        got[on] = eng.generate([prompt], SamplingParams(max_tokens=24))[0]
        s = eng.stats()
    assert got[True] == got[False] and len(got[True]) == 24
    assert s.spec_acceptance_rate > 0.5 and s.steps < 16
