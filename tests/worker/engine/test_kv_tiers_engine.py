"""KV tiers inside the engine: an evicted prefix comes back from host RAM or disk as a cache hit, with the
bytes it left with and the greedy output of a recompute; the cost model can refuse; a bad file is recomputed;
retention; block reports carry the tiers. Every test ends with every page back in the pool."""

from __future__ import annotations

import os
import random

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.debug import DebugEngine, pages_idle
from worker.kvcache.events import kv_report
from worker.kvcache.tensors import bytes_per_page
from worker.kvcache.tiers.cost import Rate
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams, block_id, chain
from worker.protocol.stats import decode_kv, kv_fields

PAGES = 30  # 480 tokens: two 300-token prompts do not fit together
NS = b"tenant"
PREFILL_TPS = 1000.0  # the tiny model's prefill rate as the cost model sees it here: slower than any load


class FixedRate(Rate):
    """A rate no measurement moves. The tiny model prefills so fast that with the measured rate a restore
    could look "not worth it" whenever a loaded machine slowed a disk read, and tests that expect one failed
    by chance."""

    def add(self, amount: float, seconds: float) -> None:
        return None


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_tiny_model(dtype="float32", device="cpu")


def engine(model, kv_dtype: str = "model", **kw) -> Engine:
    per_page = bytes_per_page(model.config, model.dtype, 16, kv_dtype)
    kw.setdefault("kv_host_bytes", 64 << 20)
    eng = DebugEngine(model, EngineConfig(kv_cache_bytes=PAGES * per_page, kv_dtype=kv_dtype, **kw))
    if eng.restorer is not None and eng.restorer.tiers is not None:
        eng.restorer.tiers.cost.prefill = FixedRate(PREFILL_TPS)
    return eng


def prompts(seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    # type: ignore[return-value]
    return tuple([rng.randrange(3, 40000) for _ in range(300)] for _ in range(2))


def ask(eng: Engine, rid: str, prompt: list[int], retention: str = "") -> tuple[list[int], int]:
    eng.add_request(rid, prompt, SamplingParams(max_tokens=6, ignore_eos=True, cache_retention=retention),
                    namespace=NS)
    toks, cached = [], -1
    while eng.has_work():
        for out in eng.step():
            toks += out.new_tokens
            cached = out.cached_tokens if cached < 0 else cached
    return toks, cached


def no_leaks(eng: Engine) -> None:
    assert pages_idle(eng)
    eng.cache.check_invariants()
    eng.cache.evict(eng.pool.num_pages)
    assert eng.pool.all_free()
    eng.close()


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_an_evicted_prefix_is_restored_as_a_cache_hit(tiny, kv_dtype):
    a, b = prompts()
    runs = {}
    for on in (False, True):
        eng = engine(tiny, kv_dtype, kv_host_bytes=None if on else 0)
        if kv_dtype == "int8":  # twice the pages per byte: fill the pool with a third prompt
            ask(eng, "c", prompts(1)[0])
        runs[on] = (ask(eng, "a1", a), ask(eng, "b", b), ask(eng, "a2", a), eng.stats())
        no_leaks(eng)
    off, on = runs[False], runs[True]
    assert on[0][0] == off[0][0] and on[2][0] == off[2][0] and on[2][0] == on[0][0]  # same greedy tokens
    # all whole pages of prompt[:-1] cached, restored ones included
    assert on[2][1] == 288 and off[2][1] < 288
    assert on[3].tiers.restored_tokens == 288 - off[2][1] and on[3].tiers.ram_hits > 0
    assert on[3].prefill_tokens_computed == off[3].prefill_tokens_computed - (288 - off[2][1])
    assert off[3].tiers is None


def test_restored_pages_hold_the_bytes_they_left_with(tiny):
    a, b = prompts()
    eng = engine(tiny)
    ask(eng, "a1", a)
    tiers = eng.restorer.tiers
    keys = chain(NS, NS, a[:299], 16)
    ask(eng, "b", b)
    held = [k for k in keys if k in tiers.host]
    assert held, "a's pages were evicted to the tier"
    kept = torch.stack([tiers.host.get(k).data for k in held]).clone()
    ask(eng, "a2", a)
    pages = [eng.cache.snapshot()[NS][tuple(a[:16 * (keys.index(k) + 1)])] for k in held]
    assert torch.equal(tiers.codec.read(pages), kept)
    no_leaks(eng)


def test_the_cost_model_can_refuse_a_restore(tiny):
    a, b = prompts()
    eng = engine(tiny)
    eng.restorer.tiers.cost.restore.value = 1.0  # loading looks slower than any prefill (1 byte/s)
    ask(eng, "a1", a)
    ask(eng, "b", b)
    _, cached = ask(eng, "a2", a)
    st = eng.stats().tiers
    assert cached < 288 and st.restored_tokens == 0 and st.skipped_by_cost > 0
    no_leaks(eng)


def _disk_engine(tiny, tmp_path, **kw) -> Engine:
    per_page = bytes_per_page(tiny.config, tiny.dtype, 16, "model")
    return engine(tiny, kv_host_bytes=4 * per_page, kv_disk_dir=str(tmp_path), kv_disk_min_hits=0, **kw)


def test_disk_restore_then_a_corrupt_file_is_recomputed(tiny, tmp_path):
    a, b = prompts()
    eng = _disk_engine(tiny, tmp_path)
    want, _ = ask(eng, "a1", a)
    ask(eng, "b", b)
    eng.restorer.tiers.disk.flush()
    assert eng.stats().tiers.disk_writes > 0
    got, cached = ask(eng, "a2", a)
    assert got == want and cached == 288 and eng.stats().tiers.disk_hits > 0
    ask(eng, "b2", b)  # a out again
    eng.restorer.tiers.disk.flush()
    for path in eng.restorer.tiers.disk.dir.glob("*/*.kv"):
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    # RAM lost
    eng.restorer.tiers.host = type(eng.restorer.tiers.host)(eng.restorer.tiers.host.capacity_bytes)
    got, cached = ask(eng, "a3", a)
    st = eng.stats().tiers
    assert got == want and st.disk_corrupt > 0 and cached < 288
    no_leaks(eng)


def test_a_disk_tier_of_other_weights_is_never_restored(tiny, tmp_path):
    """Two models of the same id and tokenizer but other weights (seeds 1234 and 4321) on one disk directory:
    the second restores nothing the first wrote, and answers as it does fresh (the fingerprint names the
    weights)."""
    a, b = prompts()
    first = _disk_engine(load_tiny_model(dtype="float32", device="cpu", seed=1234), tmp_path)
    ask(first, "a1", a)
    ask(first, "b", b)
    first.restorer.tiers.disk.flush()
    assert first.stats().tiers.disk_writes > 0
    first.close()
    other = load_tiny_model(dtype="float32", device="cpu", seed=4321)
    fresh, _ = ask(engine(other, kv_host_bytes=0), "f", a)
    second = _disk_engine(other, tmp_path)
    assert second.kv_fingerprint != first.kv_fingerprint
    got, cached = ask(second, "a2", a)
    assert cached == 0 and got == fresh and second.stats().tiers.disk_hits == 0
    no_leaks(second)


def test_in_memory_retention_never_reaches_disk(tiny, tmp_path):
    a, b = prompts()
    eng = _disk_engine(tiny, tmp_path)
    ask(eng, "a1", a, retention="in_memory")
    ask(eng, "b", b, retention="in_memory")
    ask(eng, "a2", a, retention="in_memory")
    eng.restorer.tiers.disk.flush()
    assert eng.stats().tiers.disk_writes == 0 and eng.stats().tiers.ram_evictions > 0
    no_leaks(eng)


def test_block_reports_carry_tier_changes(tiny):
    a, b = prompts()
    eng = engine(tiny)
    ask(eng, "a1", a)
    kv_report(eng.cache, 16, "t")  # drain the first batch
    ask(eng, "b", b)
    report = decode_kv(kv_fields(kv_report(eng.cache, 16, "t")))
    ids = {block_id(h) for h in chain(NS, NS, a[:299], 16)}
    # out of memory, into a tier
    assert set(report.tiered) & ids and set(report.tiered) <= set(report.evicted)
    snap = decode_kv(kv_fields(kv_report(eng.cache, 16, "t", snapshot=True)))
    assert set(snap.tiered) == set(report.tiered) and snap.snapshot
    old = kv_fields(kv_report(eng.cache, 16, "t"))
    assert "tadd" not in old and "tdel" not in old  # no tier change: the map an older gateway knows
    no_leaks(eng)


def test_disk_reads_start_while_the_request_waits(tiny, tmp_path):
    a, b = prompts()
    eng = _disk_engine(tiny, tmp_path)
    want, _ = ask(eng, "a1", a)
    ask(eng, "b", b)
    tiers = eng.restorer.tiers
    for key in tiers.host.keys():  # RAM written back and lost: only the disk holds a's evicted pages now
        tiers.disk.submit(key, tiers.host.get(key).data)
    tiers.disk.flush()
    tiers.host = type(tiers.host)(tiers.host.capacity_bytes)
    eng.add_request("a2", a, SamplingParams(max_tokens=6, ignore_eos=True), namespace=NS)
    assert tiers._prefetch, "reads start at arrival, before any step"
    # the queue wait outlasts the reads (else the rest is recomputed)
    for fut in list(tiers._prefetch.values()):
        fut.result(timeout=30)
    got, cached = [], -1
    while eng.has_work():
        for out in eng.step():
            got += out.new_tokens
            cached = out.cached_tokens if cached < 0 else cached
    assert got == want
    assert cached == 288, (cached, tiers.stats)
    assert tiers.stats.disk_hits > 0 and not tiers._prefetch
    no_leaks(eng)


def test_auto_host_size_is_an_eighth_of_available_memory_at_least_the_pool(monkeypatch, tmp_path):
    from worker.engine.scheduling import restore
    from worker.kvcache.tiers import host_budget

    monkeypatch.setenv(host_budget.CLAIMS_ENV, str(tmp_path / "claims.json"))
    assert restore._available_memory() > 0  # this machine's MemAvailable is readable
    monkeypatch.setattr(restore, "_total_memory", lambda: 64 << 40)  # a host budget that never binds here
    monkeypatch.setattr(restore, "_available_memory", lambda: 16 << 30)
    assert restore.default_host_bytes(1 << 20) == 2 << 30  # 1/8 of 16 GiB
    assert restore.default_host_bytes(3 << 30) == 3 << 30  # at least the pool ...
    assert restore.default_host_bytes(12 << 30) == 4 << 30  # ... up to 1/4 of available memory
    monkeypatch.setattr(restore, "_available_memory", lambda: 1 << 40)
    assert restore.default_host_bytes(1 << 20) == 64 << 30  # at most 64 GiB


def test_the_workers_of_a_host_share_one_eighth_of_its_memory(monkeypatch, tmp_path):
    """Eight workers on a 64 GiB host each asking for 8 GiB: together they get 8 GiB, not 64; a dead worker's
    claim goes back to the budget, and a restarted process keeps one claim."""
    import json
    import subprocess
    import sys

    from worker.kvcache.tiers import host_budget

    monkeypatch.setenv(host_budget.CLAIMS_ENV, str(tmp_path / "claims.json"))
    probe = ("import sys; from worker.kvcache.tiers.host_budget import claim; "
             "print(claim(8 << 30, 64 << 30))")
    grants = [int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                 env={**os.environ}).stdout) for _ in range(3)]
    assert grants == [8 << 30] * 3  # each probe exits before the next: its claim is dropped
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        # a live worker holds 7
        (tmp_path / "claims.json").write_text(json.dumps({str(sleeper.pid): 7 << 30}))
        assert host_budget.claim(8 << 30, 64 << 30) == 1 << 30
        assert host_budget.claim(8 << 30, 64 << 30) == 1 << 30  # claiming again replaces this process's claim
    finally:
        sleeper.kill()
        sleeper.wait()
    assert host_budget.claim(8 << 30, 64 << 30) == 8 << 30
