"""The engine with grammar requests (tiny random model, default tokenizer): valid JSON at temperature 1 beside
unconstrained requests, stop rules (EOS kept under ignore_eos, max_tokens first is "length"), wire checks."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.debug import pages_idle
from worker.engine.records.request_errors import RequestError
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams, json_object_spec, json_schema_spec

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_model(dtype="float32", device="cpu")


@pytest.fixture
def engine(tiny):
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=16 << 20))
    yield eng
    eng.close()


def _run(eng: Engine, reqs: dict[str, SamplingParams]) -> dict[str, tuple[list[int], str]]:
    for i, (rid, sp) in enumerate(reqs.items()):
        eng.add_request(rid, [1, 5, 9, 10 + i], sp)
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    done: dict[str, str] = {}
    while eng.has_work():
        for o in eng.step():
            out[o.rid].extend(o.new_tokens)
            if o.finish_reason is not None:
                assert o.error is None, o.error
                done[o.rid] = o.finish_reason
    return {rid: (out[rid], done[rid]) for rid in reqs}


def test_constrained_rows_validate_beside_free_ones(engine, tiny):
    grammar = json_schema_spec(SCHEMA).to_dict()
    reqs = {f"g{s}": SamplingParams(max_tokens=80, temperature=1.0, seed=s, grammar=grammar)
            for s in range(12)}
    reqs |= {f"f{s}": SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True)
             for s in range(3)}
    validator = jsonschema_rs.validator_for(SCHEMA)
    for rid, (tokens, reason) in _run(engine, reqs).items():
        if rid.startswith("f"):
            assert reason == "length" and len(tokens) == 8
            continue
        text = tiny.tokenizer.decode(tokens)
        assert reason == "stop" and validator.is_valid(json.loads(text)), (rid, text)
    assert pages_idle(engine)


def test_ignore_eos_still_stops_and_max_tokens_first_is_length(engine, tiny):
    res = _run(engine, {
        "obj": SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True,
                              grammar=json_object_spec().to_dict()),
        "cut": SamplingParams(max_tokens=3, temperature=1.0, seed=3,
                              grammar=json_schema_spec(SCHEMA).to_dict()),
    })
    tokens, reason = res["obj"]
    if reason == "stop":
        assert isinstance(json.loads(tiny.tokenizer.decode(tokens)), dict)
    tokens, reason = res["cut"]
    assert reason == "length" and len(tokens) == 3 and tiny.tokenizer.decode(tokens).startswith('{"')


def test_bad_grammar_maps_are_bad_requests(engine):
    bad = SamplingParams(grammar={"kind": "json_schema", "body": '{"not": {}}'})
    engine.add_request("a", [1, 2], bad)  # checked off the caller's thread: the error comes from a step
    outs = []
    while engine.has_work():
        outs += engine.step()
    [out] = outs
    assert out.finish_reason == "error" and out.error.code == "bad_request"
    assert out.error.param == "response_format"
    with pytest.raises(RequestError) as err:  # the failure is cached: the same map fails at once
        engine.add_request("b", [1, 2], bad)
    assert err.value.code == "bad_request" and err.value.param == "response_format"
    with pytest.raises(RequestError) as err:
        engine.add_request("c", [1, 2], SamplingParams(grammar={"kind": "regex", "body": "x"}))
    assert err.value.param == "response_format"
    with pytest.raises(RequestError) as err:
        SamplingParams.from_dict({"max_tokens": 4, "grammar": "x"})
    assert err.value.param == "response_format"
    assert not engine.has_work()


def test_wire_map_carries_grammar_only_when_set():
    assert "grammar" not in SamplingParams().to_dict()
    sp = SamplingParams(grammar=json_object_spec().to_dict())
    assert SamplingParams.from_dict(sp.to_dict()) == sp
