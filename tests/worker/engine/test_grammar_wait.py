"""Grammar work off the engine's loop (worker.engine.scheduling.grammar_wait): a compiling request waits
outside the scheduler while others step, one validation and one compile serve every frame of a request, a
compile past its deadline fails only its requests (a queued one is cancelled), and pending compiles are
bounded per worker and tenant."""

from __future__ import annotations

import threading
import time

import pytest

from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.debug import pages_idle
from worker.engine.records.request_errors import RequestError
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams, grammar_spec, json_schema_spec
from worker.sample import grammar

pytestmark = pytest.mark.timeout(120)


def schema(i: int) -> dict:
    return json_schema_spec({"type": "object", "properties": {"n": {"type": "integer", "minimum": i}},
                             "required": ["n"], "additionalProperties": False}).to_dict()


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_model(dtype="float32", device="cpu")


@pytest.fixture
def gate(monkeypatch):
    """Compile jobs wait for `gate.set()` (at most 10 s), so a test controls how long a compile takes."""
    event = threading.Event()
    real = grammar.compile_wire

    def slow(tokenizer, wire):
        event.wait(10)
        return real(tokenizer, wire)

    monkeypatch.setattr(grammar, "compile_wire", slow)
    yield event
    event.set()


def run(eng: Engine, limit_s: float = 30.0) -> dict:
    """Step until idle: {rid: (tokens, finish_reason, error)}."""
    done: dict = {}
    toks: dict = {}
    deadline = time.monotonic() + limit_s
    while eng.has_work():
        assert time.monotonic() < deadline
        if not eng.ready():
            time.sleep(0.005)
        for out in eng.step():
            toks.setdefault(out.rid, []).extend(out.new_tokens)
            if out.finish_reason is not None:
                done[out.rid] = (toks[out.rid], out.finish_reason, out.error)
    return done


def test_a_compiling_request_waits_while_others_step(tiny, gate):
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=16 << 20))
    try:
        t0 = time.monotonic()
        eng.add_request("g", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0, grammar=schema(0)))
        assert time.monotonic() - t0 < 0.5  # the call does not wait for the compile
        eng.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True))
        outs: dict = {}
        while eng.is_running("plain"):
            for out in eng.step():
                outs.setdefault(out.rid, []).append(out)
        assert len([t for o in outs["plain"] for t in o.new_tokens]) == 6
        assert "g" not in outs and eng.has_work() and not eng.ready()
        assert eng.stats().num_waiting == 1
        gate.set()
        done = run(eng)
        assert done["g"][1] in ("stop", "length") and done["g"][2] is None and done["g"][0]
        assert pages_idle(eng)
    finally:
        eng.close()


def test_one_validation_and_one_compile_serve_every_frame(tiny, monkeypatch):
    checks = []
    real_check = grammar_spec._check_grammar
    monkeypatch.setattr(grammar_spec, "_check_grammar", lambda g, p: (checks.append(1), real_check(g, p)))
    wire = schema(3)
    checks.clear()  # building the wire map above validated it once (the gateway's check)
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=32 << 20, max_num_seqs=128))
    try:
        for i in range(16 * 8):  # 16 prompts x n 8, each frame with its own copy of the map
            eng.add_request(f"r{i}", [1 + i % 16, 2, 3], SamplingParams(max_tokens=2, temperature=1.0,
                                                                        grammar=dict(wire)))
        done = run(eng)
        assert len(done) == 128 and all(err is None for _, _, err in done.values())
        cache = eng._grammars.cache
        assert len(checks) == 1 and (cache.misses, cache.hits) == (1, 127)
    finally:
        eng.close()


def test_a_compile_past_its_deadline_fails_only_its_requests(tiny, gate):
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=16 << 20, grammar_compile_timeout_s=0.3))
    try:
        t0 = time.monotonic()  # before the requests: their deadlines start when they are added
        for i in range(3):  # two compile threads: the third compile is still queued at the deadline
            eng.add_request(f"g{i}", [1, 2],
                            SamplingParams(max_tokens=4, temperature=1.0, grammar=schema(10 + i)))
        queued = eng._grammars._waiting["g2"].future
        eng.add_request("plain", [4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
        done = run(eng)
        assert 0.3 <= time.monotonic() - t0 < 5
        assert done["plain"][1] == "length" and len(done["plain"][0]) == 4
        for i in range(3):
            _, reason, err = done[f"g{i}"]
            assert reason == "error" and err.code == "capacity" and err.retryable
            assert "timed out" in err.message
        assert queued.cancelled() and ("json_schema", schema(12)["body"]) not in eng._grammars.cache
        assert pages_idle(eng)
    finally:
        gate.set()
        eng.close()


def test_pending_compiles_are_bounded_per_worker_and_tenant(tiny, gate):
    eng = Engine(tiny,
                 EngineConfig(kv_cache_bytes=16 << 20, grammar_max_pending=2, grammar_max_pending_per_ns=1))
    try:
        sp = [SamplingParams(max_tokens=2, temperature=1.0, grammar=schema(20 + i)) for i in range(3)]
        eng.add_request("a0", [1, 2], sp[0], namespace=b"tenant-a")
        eng.add_request("a0-sibling", [1, 3], sp[0], namespace=b"tenant-a")  # joins the pending compile
        with pytest.raises(RequestError) as err:
            eng.add_request("a1", [1, 2], sp[1], namespace=b"tenant-a")
        assert err.value.code == "capacity" and err.value.retryable and "tenant" in err.value.message
        eng.add_request("b1", [1, 2], sp[1], namespace=b"tenant-b")
        with pytest.raises(RequestError) as err:
            eng.add_request("c2", [1, 2], sp[2], namespace=b"tenant-c")
        assert err.value.code == "capacity" and err.value.retryable and "worker" in err.value.message
        assert not eng.is_running("a1") and not eng.is_running("c2")
        gate.set()
        done = run(eng)
        assert set(done) == {"a0", "a0-sibling", "b1"} and all(e is None for _, _, e in done.values())
        eng.add_request("c2", [1, 2], sp[2], namespace=b"tenant-c")  # room again once compiles finished
        assert run(eng)["c2"][2] is None
        assert pages_idle(eng)
    finally:
        eng.close()


def test_an_aborted_waiter_cancels_its_queued_compile(tiny, gate):
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=16 << 20))
    try:
        for i in range(3):
            eng.add_request(f"g{i}", [1, 2],
                            SamplingParams(max_tokens=2, temperature=1.0, grammar=schema(30 + i)))
        queued = eng._grammars._waiting["g2"].future
        assert eng.abort("g2") and queued.cancelled()
        assert [o.finish_reason for o in eng.step() if o.rid == "g2"] == ["abort"]
        gate.set()
        done = run(eng)
        assert set(done) == {"g0", "g1"}
        assert pages_idle(eng)
    finally:
        eng.close()
