"""Sampling: parameter validation/wire form, restriction of the support, seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from bench.cpu_kernels import full_sort_restrict, prefix_mass
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.debug import pages_idle
from worker.engine.records.request_errors import RequestError
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams
from worker.sample.sampler import SamplingBatch, restrict_logits, sample, uniform_noise


def batch_for(n: int, temp: float, top_k: int = 0, top_p: float = 1.0, seed0: int = 0,
              logprobs: bool = False) -> SamplingBatch:
    return SamplingBatch(torch.full((n,), temp), torch.full((n,), top_k, dtype=torch.int64),
                         torch.full((n,), top_p), torch.arange(seed0, seed0 + n, dtype=torch.int64),
                         torch.zeros(n, dtype=torch.int64), False, top_k > 0, top_p < 1, logprobs)


def test_top_k_restricts_support():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0)).repeat(400, 1)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    tokens = sample(logits, batch_for(400, temp=2.0, top_k=5)).tokens
    drawn = set(tokens.tolist())
    assert drawn <= allowed and len(drawn) >= 3


def test_top_p_restricts_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * 4) + 1e-9
    logits = probs.log()[None].repeat(500, 1)
    # 0.79, not 0.8: the mass before token 2 is 0.8 up to rounding, which is the edge itself
    masked = restrict_logits(logits[:1], torch.tensor([0]), torch.tensor([0.79]))
    assert torch.isfinite(masked[0]).tolist() == [True, True] + [False] * 6
    tokens = sample(logits, batch_for(500, temp=1.0, top_p=0.79)).tokens
    assert set(tokens.tolist()) == {0, 1}


@pytest.mark.parametrize("scale", [2.0, 6.0, 12.0])
@pytest.mark.parametrize("top_k,top_p",
                         [(0, 0.9), (50, 1.0), (40, 0.8), (1000, 0.95), (5000, 0.99), (0, 0.999)])
def test_restriction_matches_the_full_sort_definition(scale, top_k, top_p):
    """The candidate-first restriction keeps exactly the set a full sort keeps, flat rows (past every
    candidate size) and peaked rows alike."""
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(int(scale))) * scale
    got = torch.isfinite(restrict_logits(logits, torch.full((6,), top_k), torch.full((6,), top_p)))
    want = torch.isfinite(full_sort_restrict(logits, top_k, top_p))
    # Both sides sum in float64: over <= 49,152 terms each errs by < 49152 * 2^-53 ~ 5.5e-12, so a verdict may
    # differ only for a token whose mass-before lies within 1e-9 of top_p. Those are the only ones excused.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    keep = torch.arange(logits.shape[1])[None, :] < (top_k or logits.shape[1])
    edge_sorted = ((prefix_mass(sorted_logits, keep.expand_as(logits)) - top_p).abs() < 1e-9) & (top_p < 1)
    edge = torch.zeros_like(edge_sorted).scatter_(-1, order, edge_sorted)
    assert edge.sum() <= 1  # these seeds put (almost) no token that close to the edge
    assert torch.equal(got & ~edge, want & ~edge), (got != want).sum(dim=1)


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 6000
    tokens = sample(probs.log()[None].repeat(n, 1), batch_for(n, temp=1.0)).tokens
    freq = torch.bincount(tokens, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_noise_is_deterministic_and_uniform():
    seed, step = torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0])
    a, b = uniform_noise(seed, step, 5000), uniform_noise(seed, step, 5000)
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert 0.0 < a.min() and a.max() < 1.0 and abs(a.mean().item() - 0.5) < 0.02


def test_logprobs_of_chosen_token():
    logits = torch.randn(4, 50)
    b = batch_for(4, temp=0.0, logprobs=True)
    b.all_greedy = True
    out = sample(logits, b)
    tokens, lp = out.tokens, out.logprobs
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).max(-1).values)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def test_seeded_request_is_reproducible(tiny):
    prompt = list(range(10, 40))
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=8 << 20))
    first = eng.generate([prompt], params)[0]
    again = Engine(tiny, EngineConfig(kv_cache_bytes=8 << 20)).generate([prompt], params)[0]
    other = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=43,
                                                  ignore_eos=True))[0]
    assert first == again and len(first) == 24
    assert first != other
    # the same seeded request beside other traffic still draws the same tokens
    crowd = eng.generate([list(range(50, 90)), prompt, [3] * 17],
                         [SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True), params,
                          SamplingParams(max_tokens=5, temperature=0.7, ignore_eos=True)])
    assert crowd[1] == first
    assert pages_idle(eng)


def test_logprobs_reported_per_token(tiny):
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=8 << 20))
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, logprobs=True, ignore_eos=True))
    lps = []
    while eng.has_work():
        for o in eng.step():
            assert o.logprobs is not None and len(o.logprobs) == len(o.new_tokens)
            lps.extend(o.logprobs)
    assert len(lps) == 4 and all(lp <= 0.0 for lp in lps)


def test_params_from_dict_and_validate():
    p = SamplingParams.from_dict({"max_tokens": 5, "temperature": 1, "stop_token_ids": [2, 3], "seed": 9})
    assert p.temperature == 1.0 and p.stop_token_ids == (2, 3)
    assert SamplingParams.from_dict(p.to_dict()) == p
    for bad, param in [({"max_tokens": "5"}, "max_tokens"), ({"temperature": True}, "temperature"),
                       ({"nope": 1}, "nope"), ({"stop_token_ids": [1.5]}, "stop_token_ids")]:
        with pytest.raises(RequestError) as err:
            SamplingParams.from_dict(bad)
        assert err.value.code == "bad_request" and err.value.param == param
    with pytest.raises(RequestError) as err:
        SamplingParams(stop_token_ids=(99,)).validate(50)
    assert err.value.param == "stop_token_ids"


def test_cpu_race_kernel_draws_what_the_torch_path_draws():
    """The fused C++ sampler against its torch reference: 64-bit seeds, flat and peaked rows, masked
    tokens."""
    from worker.kernels.cpu import race_sample_kernel
    from worker.sample.sampler import race_draw

    kernel = race_sample_kernel()
    if kernel is None:
        pytest.skip("no C++ compiler: the torch path is the only one")
    gen = torch.Generator().manual_seed(3)
    n, vocab = 48, 49152
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.1, 8.0, n)[:, None]
    logits[::5, vocab // 3:] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    b = batch_for(n, temp=1.0, seed0=11)
    b.step = torch.arange(n, dtype=torch.int64) * 7
    for hi in (None, torch.arange(n, dtype=torch.int64) * 0x9E3779B9 % (1 << 32)):
        b.seed_hi = hi
        want = race_draw(probs.clone(), b)
        got = kernel(probs, b.seed, b.step, hi if hi is not None else torch.empty(0, dtype=torch.int64))
        assert torch.equal(got, want)
    assert kernel(probs[:0], b.seed[:0], b.step[:0], torch.empty(0, dtype=torch.int64)).numel() == 0
