"""The radix prefix cache inside the engine: reuse, isolation, eviction, preemption, ordering.

The output-equality test runs the real default model in fp32 (cache on vs off,
same greedy tokens, far fewer prefill tokens computed); the rest use the tiny
random-weight Llama. Every test ends with a leak check: each page is free or
held once, unlocked, by the tree (`worker.engine.debug.pages_idle`), and evicting the whole
tree returns every page to the pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.core import DEFAULT_NAMESPACE, Engine
from worker.engine.debug import DebugEngine, pages_idle
from worker.engine.scheduling.waiting_order import CACHE_AWARE_MAX_SKIPS
from worker.kvcache.tensors import bytes_per_token
from worker.model.loader import load_model
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def make_engine(model, pages: int = 512, **kw) -> Engine:
    per_page = bytes_per_token(model.config, model.dtype) * 16
    return DebugEngine(model, EngineConfig(kv_cache_bytes=pages * per_page, **kw))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 40000) for _ in range(n)]


def drain(engine: Engine, capture: list | None = None, max_steps: int = 5000) -> dict[str, list]:
    """Step until idle; returns per rid [tokens, cached_tokens of the first output, finish step]."""
    res: dict[str, list] = {}
    for step in range(max_steps):
        if not engine.has_work():
            return res
        for out in engine.step(capture):
            r = res.setdefault(out.rid, [[], out.cached_tokens, None])
            r[0].extend(out.new_tokens)
            if out.finish_reason is not None:
                r[2] = step
    raise AssertionError("engine did not drain")


def assert_no_leaks(engine: Engine) -> None:
    cache = engine.cache
    assert pages_idle(engine)
    if cache is not None:
        cache.check_invariants()
        assert engine.pool.num_free + cache.cached_pages == engine.pool.num_pages
        cache.evict(engine.pool.num_pages)
    assert engine.pool.all_free()


@pytest.mark.heavy  # quality gate / default-model end to end: `make test-heavy`, its own CI step
def test_greedy_outputs_equal_cache_on_and_off_with_far_less_prefill():
    torch.set_num_threads(1)
    model = load_model("default", dtype="float32", device="cpu")
    system = ("You are a helpful assistant for a travel agency. Answer briefly and politely, mention prices "
              "in "
              "euros, never invent facts, and suggest one alternative when a trip is not possible. ") * 7
    questions = ["Is Rome nice in May?", "How far is Lisbon from Porto?", "Can I take a train to Vienna?",
                 "What does a ferry to Crete cost?", "Is Oslo expensive?", "Where should I stay in Paris?",
                 "Do I need a visa for Norway?", "When is the best time for Iceland?"]
    tok = model.tokenizer
    prefix = tok.encode(system)
    prompts = [prefix + tok.encode(q, add_special_tokens=False) for q in questions]
    assert len(prefix) >= 240
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    runs = {}
    for on in (False, True):
        eng = DebugEngine(model, EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_cache=on))
        for i, p in enumerate(prompts):
            eng.add_request(f"q{i}", p, params)
        runs[on] = (drain(eng), eng.stats())
        assert_no_leaks(eng)
    (off, off_stats), (on, on_stats) = runs[False], runs[True]
    assert {r: v[0] for r, v in on.items()} == {r: v[0] for r, v in off.items()}
    assert off_stats.prefill_tokens_computed == sum(map(len, prompts)) and off_stats.cached_tokens == 0
    assert on_stats.prefill_tokens_computed <= 0.2 * off_stats.prefill_tokens_computed
    hits = sorted(v[1] for v in on.values())
    assert hits[0] == 0 and all(h >= len(prefix) - 16 for h in hits[1:])  # all but the first reuse the prefix
    assert on_stats.cached_tokens == sum(hits) and on_stats.prompt_tokens == sum(map(len, prompts))
    assert on_stats.prefix_hit_rate == pytest.approx(sum(hits) / sum(map(len, prompts)))


def test_namespaces_never_share(tiny):
    eng = make_engine(tiny)
    prompt = rand_prompt(random.Random(1), 70)
    eng.add_request("a", prompt, greedy(3), namespace=b"tenant-a")
    first = drain(eng)
    eng.add_request("b", prompt, greedy(3), namespace=b"tenant-b")
    other = drain(eng)
    eng.add_request("a2", prompt, greedy(3), namespace=b"tenant-a")
    again = drain(eng)
    eng.add_request("d", prompt, greedy(3))  # no namespace: the engine's default one
    eng.add_request("d2", prompt, greedy(3), namespace=DEFAULT_NAMESPACE)
    default = drain(eng)
    assert first["a"][1] == 0 and other["b"][1] == 0
    assert again["a2"][1] == 64  # whole pages of prompt[:-1]
    assert default["d"][1] == 0 and default["d2"][1] == 64
    assert first["a"][0] == other["b"][0] == again["a2"][0] == default["d2"][0]
    assert_no_leaks(eng)
    with pytest.raises(Exception) as err:
        eng.add_request("s", prompt, greedy(3), namespace="tenant-a")  # type: ignore[arg-type]
    assert getattr(err.value, "code", None) == "bad_request"


def test_working_set_larger_than_cache_completes_with_evictions(tiny):
    eng = make_engine(tiny, pages=40, max_num_batched_tokens=128)
    rng = random.Random(2)
    bases = [rand_prompt(rng, 96) for _ in range(6)]  # 6 x 6 pages of prefixes: more than the pool keeps
    expect = {}
    for rnd in range(3):
        for i, base in enumerate(bases):
            rid = f"r{rnd}-{i}"
            eng.add_request(rid, base + rand_prompt(rng, rng.randrange(1, 20)), greedy(rng.randrange(4, 30)),
                            namespace=b"ns%d" % (i % 2))
            expect[rid] = eng._seqs[rid].sampling.max_tokens
        res = drain(eng)
        assert {r: len(v[0]) for r, v in res.items()} == {r: n for r, n in expect.items() if r in res}
        assert len(res) == len(bases)
        st = eng.stats()
        assert st.kv_free_tokens == st.kv_total_tokens  # idle: everything free or evictable
        assert st.free_pages + st.cached_pages == 40 and st.locked_pages == 0
    st = eng.stats()
    assert st.evicted_pages > 0 and st.cached_tokens > 0
    assert_no_leaks(eng)


def resumes(capture: list) -> list[tuple[str, int, int]]:
    """(rid, resume position, recomputed tokens) for each time a sequence restarted after preemption."""
    out, end, high = [], {}, {}
    for rid, pos, logits in capture:
        if pos < end.get(rid, 0):  # went back: preempted, resumed from `pos` (its cached prefix)
            out.append((rid, pos, high[rid] - pos))
        end[rid] = pos + logits.shape[0]
        high[rid] = max(high.get(rid, 0), end[rid])
    return out


def test_preempted_sequence_resumes_from_its_cached_prefix(tiny):
    rng = random.Random(3)
    prompts = {f"p{i}": rand_prompt(rng, 160) for i in range(4)}  # 4 x 14 pages wanted, 52 in the pool
    runs = {}
    for on in (False, True):
        # spec_tokens=0: a verify chunk's rolled-back drafts would read as resumes here
        eng = make_engine(tiny, pages=52, max_num_batched_tokens=64, enable_prefix_cache=on, spec_tokens=0)
        for rid, p in prompts.items():
            eng.add_request(rid, p, greedy(60))
        capture: list = []
        got = drain(eng, capture)
        assert eng.stats().preemptions > 0
        runs[on] = ({r: v[0] for r, v in got.items()}, resumes(capture))
        assert_no_leaks(eng)
    (off, off_resumes), (on, on_resumes) = runs[False], runs[True]
    assert on == off and len(on["p0"]) == 60
    assert off_resumes and all(pos == 0 for _, pos, _ in off_resumes)  # without the cache: from scratch
    assert on_resumes and all(pos > 0 and redone < 160 for _, pos, redone in on_resumes), on_resumes


def test_concurrent_requests_share_a_prefix_being_prefilled(tiny):
    eng = make_engine(tiny)
    rng = random.Random(4)
    system = rand_prompt(rng, 300)
    prompts = [system + rand_prompt(rng, 5 + i) for i in range(4)]
    for i, p in enumerate(prompts):  # all at once: the later ones wait for the first one's prefix
        eng.add_request(f"c{i}", p, greedy(4))
    res = drain(eng)
    st = eng.stats()
    assert res["c0"][1] == 0 and all(res[f"c{i}"][1] == 288 for i in range(1, 4))
    assert st.prefill_tokens_computed == sum(map(len, prompts)) - 3 * 288
    off = make_engine(tiny, enable_prefix_cache=False)
    for i, p in enumerate(prompts):
        off.add_request(f"c{i}", p, greedy(4))
    assert {r: v[0] for r, v in drain(off).items()} == {r: v[0] for r, v in res.items()}
    assert_no_leaks(eng)


def test_stats_and_abort_of_a_sequence_holding_shared_pages(tiny):
    eng = make_engine(tiny, pages=64)
    prompt = rand_prompt(random.Random(5), 100)
    eng.add_request("warm", prompt, greedy(2))
    drain(eng)
    cached = eng.stats().cached_pages
    assert cached == 6 and eng.stats().evictable_pages == 6  # 101 computed tokens: 6 full pages
    eng.add_request("x", prompt + [7, 8], greedy(50))
    eng.step()
    st = eng.stats()
    assert eng._seqs["x"].cached_tokens == 96 and st.locked_pages == 6
    assert st.kv_free_tokens == (st.free_pages + st.evictable_pages) * 16
    assert st.free_pages == 64 - 6 - 1  # one page of its own for tokens 96..102
    assert eng.abort("x")
    assert eng.stats().locked_pages == 0 and eng.stats().cached_pages == cached
    assert_no_leaks(eng)


def test_cache_disabled_behaves_as_before(tiny):
    eng = make_engine(tiny, enable_prefix_cache=False)
    prompt = rand_prompt(random.Random(6), 50)
    for i in range(3):
        eng.add_request(f"n{i}", prompt, greedy(3))
    res = drain(eng)
    st = eng.stats()
    assert eng.cache is None and all(v[1] == 0 for v in res.values())
    assert st.prefill_tokens_computed == 150 and st.cached_pages == 0 and st.prefix_hit_rate == 0.0
    assert eng.pool.all_free() and st.kv_free_tokens == st.kv_total_tokens


def test_cache_aware_order_prefers_cached_prefixes_without_starving(tiny):
    rng = random.Random(7)
    shared = rand_prompt(rng, 64)
    lone = rand_prompt(rng, 64)

    def finish_order(aware: bool, n_shared: int) -> list[str]:
        eng = make_engine(tiny, max_num_seqs=1, cache_aware_order=aware)
        eng.add_request("warm", shared + [5], greedy(1))
        drain(eng)
        eng.add_request("lone", lone, greedy(1))
        for i in range(n_shared):
            eng.add_request(f"s{i}", shared + [9, i + 10], greedy(1))
        res = drain(eng)
        assert_no_leaks(eng)
        return sorted(res, key=lambda r: res[r][2])

    assert finish_order(False, 2) == ["lone", "s0", "s1"]
    assert finish_order(True, 2) == ["s0", "s1", "lone"]
    order = finish_order(True, CACHE_AWARE_MAX_SKIPS + 5)
    assert order.index("lone") == CACHE_AWARE_MAX_SKIPS  # overtaken at most MAX_SKIPS times
