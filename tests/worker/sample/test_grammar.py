"""Grammar-constrained decoding with the default model's real tokenizer and fake logits.

Random logits (fixed seeds) pick tokens through the grammar's mask; the text must parse and validate.
"""

from __future__ import annotations

import hashlib
import json

import jsonschema_rs
import pytest
import torch

from worker.protocol.grammar_spec import (
    MAX_SCHEMA_BYTES,
    TOOL_CLOSE,
    TOOL_OPEN,
    GrammarError,
    GrammarSpec,
    json_object_spec,
    json_schema_spec,
    tool_call_spec,
)
from worker.sample.grammar import (
    BatchMasker,
    CompiledGrammar,
    GrammarCache,
    GrammarState,
    apply_bitmask,
    grammar_tokenizer,
    mask_words,
)
from worker.text.tokenizer import Tokenizer, load_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        }, "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "price": {"type": "number", "minimum": 0},
    }, "required": ["sku", "qty", "price"], "additionalProperties": False}},
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "status": {"enum": ["pending", "paid", "shipped"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "note": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
        "express": {"type": "boolean"},
    },
    "required": ["id", "status", "items", "express"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
}, "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "parameters": WEATHER},
         {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                             "required": ["tz"], "additionalProperties": False}}]
SEEDS = range(20)
DEEP: dict = {"type": "array"}
for _ in range(70):
    DEEP = {"type": "array", "items": DEEP}
MAX_STEPS = 400


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def cache(tok: Tokenizer) -> GrammarCache:
    c = GrammarCache(grammar_tokenizer(tok), capacity=16)
    yield c
    c.close()


@pytest.fixture(scope="module")
def closers(tok: Tokenizer) -> torch.Tensor:
    """Tokens made only of characters that close values, so biased runs finish within MAX_STEPS."""
    ids = [i for i in range(tok.vocab_size)
           if (s := tok.decode([i])) and set(s) <= set('"}],0123456789')]
    return torch.tensor(ids + [tok.eos_token_id])


def allowed(mask_row: torch.Tensor, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def generate(state: GrammarState, tok: Tokenizer, closers: torch.Tensor, seed: int,
             max_steps: int = MAX_STEPS) -> list[int]:
    """Greedy over random logits (fixed seed) through the mask; after a seed-dependent number of steps,
    closing tokens are favoured. Checks at each step that EOS is allowed exactly when the text is complete."""
    gen = torch.Generator().manual_seed(seed)
    masker = BatchMasker(tok.vocab_size)
    close_after = 4 + 3 * seed
    out: list[int] = []
    for step in range(max_steps):
        mask, rows = masker.fill([None, state, None])  # the constrained row sits inside a batch
        assert rows.tolist() == [1]
        assert allowed(mask[0], tok.eos_token_id) == state.is_accepting()
        logits = torch.randn(3, tok.vocab_size, generator=gen)
        if step >= close_after:
            logits[:, closers] += 4.0
        free = logits.clone()
        apply_bitmask(logits, mask, rows)
        assert torch.equal(logits[0], free[0]) and torch.equal(logits[2], free[2])
        token = int(torch.argmax(logits[1]))
        assert allowed(mask[0], token)
        assert state.accept(token), state.error
        out.append(token)
        if state.is_terminated():
            break
    return out


def text_of(tokens: list[int], tok: Tokenizer) -> str:
    return tok.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("schema", [PERSON, ORDER, WEATHER], ids=["person", "order", "weather"])
def test_outputs_validate_against_the_schema(schema: dict, tok: Tokenizer, cache: GrammarCache,
                                             closers: torch.Tensor) -> None:
    compiled = cache.get(json_schema_spec(schema)).result(timeout=60)
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    for seed in SEEDS:
        state = compiled.new_state()
        tokens = generate(state, tok, closers, seed)
        assert state.is_terminated(), f"seed {seed} did not finish: {text_of(tokens, tok)!r}"
        value = json.loads(text_of(tokens, tok))
        assert validator.is_valid(value), (seed, value)


def test_json_object_yields_an_object(tok: Tokenizer, cache: GrammarCache, closers: torch.Tensor) -> None:
    compiled = cache.get(json_object_spec()).result(timeout=60)
    for seed in SEEDS:
        state = compiled.new_state()
        text = text_of(generate(state, tok, closers, seed), tok)
        assert state.is_terminated(), text
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("style", ["hermes", "json"])
def test_tool_calls_follow_the_function_schema(style: str, tok: Tokenizer, cache: GrammarCache,
                                               closers: torch.Tensor) -> None:
    compiled = cache.get(tool_call_spec(TOOLS, style)).result(timeout=60)
    validators = {t["name"]: jsonschema_rs.validator_for(t["parameters"]) for t in TOOLS}
    names = set()
    for seed in SEEDS:
        state = compiled.new_state()
        text = text_of(generate(state, tok, closers, seed), tok)
        assert state.is_terminated(), text
        if style == "hermes":
            assert text.startswith(TOOL_OPEN) and text.endswith(TOOL_CLOSE), text
            text = text[len(TOOL_OPEN):-len(TOOL_CLOSE)]
        call = json.loads(text)
        assert set(call) == {"name", "arguments"}
        assert validators[call["name"]].is_valid(call["arguments"]), call
        names.add(call["name"])
    assert names == {"get_weather", "get_time"}  # both functions are reachable


def test_eos_is_allowed_only_once_the_value_is_complete(tok: Tokenizer, cache: GrammarCache) -> None:
    state = cache.get(json_schema_spec(WEATHER)).result(timeout=60).new_state()
    row = torch.empty(mask_words(tok.vocab_size), dtype=torch.int32)
    tokens = tok.encode('{"city": "Oslo", "unit": "celsius"}', add_special_tokens=False)
    for t in tokens:
        state.fill_mask(row)
        assert not allowed(row, tok.eos_token_id) and not state.is_terminated()
        assert allowed(row, t)
        assert state.accept(t)
    assert state.is_terminated()
    state.fill_mask(row)
    assert [i for i in range(tok.vocab_size) if allowed(row, i)] == [tok.eos_token_id]


def test_a_forbidden_token_is_refused(tok: Tokenizer, cache: GrammarCache) -> None:
    state = cache.get(json_object_spec()).result(timeout=60).new_state()
    assert not state.accept(tok.encode("hello", add_special_tokens=False)[0])
    assert state.error


def test_rollback_restores_the_mask(tok: Tokenizer, cache: GrammarCache) -> None:
    state = cache.get(json_schema_spec(WEATHER)).result(timeout=60).new_state()
    before, after = (torch.empty(mask_words(tok.vocab_size), dtype=torch.int32) for _ in range(2))
    for t in tok.encode('{"city": "', add_special_tokens=False):
        assert state.accept(t)
    state.fill_mask(before)
    extra = tok.encode('Oslo", "unit', add_special_tokens=False)
    for t in extra:
        assert state.accept(t)
    assert state.rollback(len(extra))
    state.fill_mask(after)
    assert torch.equal(before, after)


def test_a_long_value_cut_by_max_tokens_is_not_terminated(tok: Tokenizer, cache: GrammarCache,
                                                         closers: torch.Tensor) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}}, "required": ["s"]}
    state = cache.get(json_schema_spec(schema)).result(timeout=60).new_state()
    tokens = generate(state, tok, closers, seed=0, max_steps=30)
    assert len(tokens) == 30 and not state.is_terminated()  # the engine ends it with finish_reason "length"


@pytest.mark.parametrize(("schema", "words"), [
    ([1, 2], "must be an object"),
    ({"type": "strng"}, "strng"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "unsupported JSON schema keyword"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "unsupported JSON schema keyword"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "(["}, "regex"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "number", "minimum": float("nan")}, "not serializable"),
    ({"enum": ["x" * 1000] * 70}, f"exceeds {MAX_SCHEMA_BYTES} bytes"),
    (DEEP, "deeper"),
])
def test_invalid_schemas_name_the_param(schema: object, words: str) -> None:
    with pytest.raises(GrammarError) as err:
        json_schema_spec(schema)
    assert err.value.param == "response_format.json_schema.schema"
    assert words in err.value.message


def test_invalid_tool_parameters_name_the_tool() -> None:
    with pytest.raises(GrammarError) as err:
        tool_call_spec([TOOLS[0], {"name": "bad", "parameters": {"type": "object", "not": {}}}])
    assert err.value.param == "tools"
    with pytest.raises(GrammarError) as err:
        tool_call_spec([TOOLS[0], {"name": "bad", "parameters": "nope"}])
    assert err.value.param == "tools[1].function.parameters"
    with pytest.raises(GrammarError) as err:
        tool_call_spec([{"name": ""}])
    assert err.value.param == "tools[0].function.name"


def test_cache_is_bounded_lru_keyed_by_digest(tok: Tokenizer) -> None:
    cache = GrammarCache(grammar_tokenizer(tok), capacity=3)
    try:
        specs = [json_schema_spec({"type": "integer", "minimum": i}) for i in range(5)]
        first = cache.get(specs[0])
        again = cache.get(json_schema_spec({"type": "integer", "minimum": 0}))  # an equal, separate dict
        assert again is first and (cache.hits, cache.misses) == (1, 1)
        assert specs[0].digest == hashlib.sha256(b'json_schema\n{"type":"integer","minimum":0}').hexdigest()
        reordered = json_schema_spec({"minimum": 0, "type": "integer"})
        assert reordered.digest != specs[0].digest  # key order decides output order: another grammar
        for spec in specs[1:]:
            cache.get(spec)
        assert len(cache) == 3
        assert cache.digests() == [s.digest for s in specs[2:]]
        assert specs[0].digest not in cache
        assert isinstance(cache.get(specs[4]).result(timeout=60), CompiledGrammar)
        assert cache.digests()[-1] == specs[4].digest
    finally:
        cache.close()


def test_a_failed_compile_surfaces_as_grammar_error(cache: GrammarCache) -> None:
    unchecked = GrammarSpec("json_schema", json.dumps({"enum": []}))  # bypasses json_schema_spec's checks
    with pytest.raises(GrammarError) as err:
        cache.get(unchecked).result(timeout=60)
    assert err.value.param == "response_format.json_schema.schema"


def test_spec_round_trips_through_the_wire() -> None:
    for spec in (json_object_spec(), json_schema_spec(PERSON), tool_call_spec(TOOLS, parallel=True)):
        assert GrammarSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(GrammarError):
        GrammarSpec.from_dict({"kind": "json_schema", "body": json.dumps({"not": {}})})
    with pytest.raises(GrammarError):
        GrammarSpec.from_dict({"kind": "regex", "body": "{}"})


def test_apply_bitmask_matches_a_bit_by_bit_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    vocab = 1000  # not a multiple of 32: the last word's spare bits must be ignored
    logits = torch.randn(4, vocab, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (2, mask_words(vocab)), generator=gen, dtype=torch.int32)
    rows = torch.tensor([3, 1])
    expect = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for t in range(vocab):
            if not allowed(mask[i], t):
                expect[r, t] = float("-inf")
    apply_bitmask(logits, mask, rows)
    assert torch.equal(logits, expect)
    assert torch.isinf(expect[1]).any() and not torch.isinf(expect[0]).any()
