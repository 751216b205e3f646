"""A resumed request (`resumed`: the last tokens were streamed by a worker that was lost) carries on exactly
where the first stream stopped: greedy, seeded sampling, penalties and grammars; bad resumes are refused by
name."""

from __future__ import annotations

import pytest

from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.debug import pages_idle
from worker.engine.records.request_errors import RequestError
from worker.model.tiny_model import load_tiny_model
from worker.protocol import SamplingParams, json_schema_spec

PROMPT = [1, 5, 9, 42, 7, 300, 11]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_model(dtype="float32", device="cpu")


def _run(tiny, tokens: list[int], sp: SamplingParams, resumed: int = 0) -> tuple[list[int], str]:
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=16 << 20))
    try:
        eng.add_request("r", tokens, sp, resumed=resumed)
        out: list[int] = []
        while eng.has_work():
            for o in eng.step():
                assert o.error is None, o.error
                out += o.new_tokens
                if o.finish_reason is not None:
                    return out, o.finish_reason
        raise AssertionError("no finish")
    finally:
        eng.close()


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3, presence_penalty=1.5,
                   frequency_penalty=0.5, repetition_penalty=1.3),
], ids=["greedy", "seeded", "penalties"])
def test_resumed_stream_equals_the_undisturbed_one(tiny, sp):
    whole, finish = _run(tiny, PROMPT, sp)
    assert finish == "length" and len(whole) == 24
    for k in (1, 10, 23):
        rest, finish_k = _run(tiny, PROMPT + whole[:k], sp, resumed=k)
        assert whole[:k] + rest == whole and finish_k == "length"  # max_tokens counts what was streamed


def test_resumed_grammar_advances_over_the_streamed_tokens(tiny):
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=5, grammar=json_schema_spec(SCHEMA).to_dict())
    whole, finish = _run(tiny, PROMPT, sp)
    assert finish == "stop" and len(whole) > 4
    k = len(whole) // 2
    rest, _ = _run(tiny, PROMPT + whole[:k], sp, resumed=k)
    assert whole[:k] + rest == whole


def test_bad_resumes_are_refused_by_name(tiny):
    eng = Engine(tiny, EngineConfig(kv_cache_bytes=16 << 20))
    try:
        for resumed, max_tokens in ((len(PROMPT), 50), (3, 3), (-1, 50)):
            with pytest.raises(RequestError) as err:
                eng.add_request(f"r{resumed}", PROMPT, SamplingParams(max_tokens=max_tokens), resumed=resumed)
            assert err.value.param == "resumed"
        grammar = SamplingParams(max_tokens=20, grammar=json_schema_spec(SCHEMA).to_dict())
        eng.add_request("g", PROMPT + [tiny.tokenizer.encode("x", add_special_tokens=False)[0]], grammar,
                        resumed=1)  # "x" cannot start the JSON value: refused once the grammar is ready
        outs = []
        while eng.has_work():
            outs += eng.step()
        (end,) = [o for o in outs if o.rid == "g"]
        assert end.finish_reason == "error" and end.error is not None and end.error.param == "resumed"
        assert pages_idle(eng)
    finally:
        eng.close()
