"""Structured outputs through the official `openai` SDK against a real gateway, Redis and worker:
`response_format` json_schema and json_object, streaming and not, and 400s for schemas that cannot be
enforced, with nothing charged. The worker serves the tiny random model (the default model's tokenizer):
its near-uniform choices stress the grammar harder than a real model, and 40 requests finish in seconds.
The stack runs the gateway's default liveness settings (`--worker-timeout` 1 s): a burst of four completions
of 16 prompts x n 8, each with its own ~55 KB schema, must not stall another tenant's stream."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import openai
import pytest

from gateway.openai.schemas import parse_chat, parse_completion
from tests.gateway_stack import GatewayStack, charged_as_invalid, start_gateway_stack, tenant_state
from worker.protocol import json_object_spec, json_schema_spec

pytestmark = pytest.mark.timeout(240)
SEEDS = range(20)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a made-up person as JSON."}]


@pytest.fixture(scope="module")
def stack() -> Iterator[GatewayStack]:
    gs = start_gateway_stack(worker_model="tiny-random", gateway_args=())  # the gateway's defaults
    try:
        yield gs
    finally:
        gs.stack.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    key = stack.stack.create_tenant("structured", max_concurrent=64)
    return openai.OpenAI(api_key=key, base_url=stack.base_url + "/v1", max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, seed: int, stream: bool, response_format: dict) -> tuple[str, str]:
    kw = {"model": "default", "messages": ASK, "temperature": 1.0, "seed": seed, "max_tokens": 120,
          "response_format": response_format}
    if not stream:
        resp = client.chat.completions.create(**kw)
        return resp.choices[0].message.content, resp.choices[0].finish_reason
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def test_json_schema_output_validates_for_every_seed(client):
    validator = jsonschema_rs.validator_for(PERSON)
    jobs = [(seed, stream) for seed in SEEDS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent, so the worker batches them
        results = list(pool.map(lambda job: _chat(client, job[0], job[1], FORMAT), jobs))
    for (seed, stream), (text, finish) in zip(jobs, results, strict=True):
        assert finish == "stop", (seed, stream, text)
        value = json.loads(text)
        assert validator.is_valid(value), (seed, stream, text)
    assert len({t for t, _ in results}) > 5  # temperature 1.0 really samples


def test_json_object_output_is_an_object(client):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda s: _chat(client, s, s % 2 == 1, {"type": "json_object"}), range(4)))
    for text, finish in results:
        assert finish in ("stop", "length")
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.startswith("{"), text


def test_text_format_is_unconstrained(client):
    resp = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=5,
                                          response_format={"type": "text"})
    assert resp.choices[0].message.content


def test_max_tokens_first_ends_with_length(client):
    resp = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=3,
                                          response_format=FORMAT)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3


@pytest.mark.parametrize(("schema", "param", "words"), [
    ({"type": "object", "properties": {"a": {"type": "nope"}}}, "response_format.json_schema.schema",
     "invalid"),
    ({"type": "array", "uniqueItems": True}, "response_format.json_schema.schema", "uniqueItems"),
    ({"type": "string", "not": {"const": "x"}}, "response_format.json_schema.schema", "not"),
    ("not a schema", "response_format.json_schema.schema", "object"),
])
def test_unusable_schema_is_400_and_charges_one_request(stack, schema, param, words):
    name = "rf-" + hashlib.sha256(json.dumps(schema).encode()).hexdigest()[:10]
    key = stack.stack.create_tenant(name)
    sdk = openai.OpenAI(api_key=key, base_url=stack.base_url + "/v1", max_retries=0, timeout=60)
    before = tenant_state(stack.stack.redis_url, name)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="default", messages=ASK, max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert err.value.body["param"] == param
    assert words in err.value.body["message"]
    # one request of rpm; no tokens, lease or usage
    assert charged_as_invalid(stack.stack.redis_url, name, before)


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}},
     "response_format.json_schema.extra"),
    ({"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}, "response_format.json_schema.name"),
])
def test_malformed_response_format_is_400(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=ASK, max_tokens=5, response_format=fmt)
    assert err.value.body["param"] == param


def test_parse_response_format_kinds():
    base = {"model": "m", "messages": ASK}
    assert parse_chat({**base, "response_format": {"type": "text"}}).grammar is None
    assert parse_chat({**base, "response_format": None}).grammar is None
    assert parse_chat({**base, "response_format": {"type": "json_object"}}).grammar == json_object_spec()
    assert parse_chat({**base, "response_format": FORMAT}).grammar == json_schema_spec(PERSON)
    completion = parse_completion({"model": "m", "prompt": "x", "response_format": FORMAT})
    assert completion.grammar == json_schema_spec(PERSON)


# ---- one tenant's grammar burst beside another tenant's stream (worker.engine.scheduling.grammar_wait) ----

STREAM_TOKENS = 600


def big_schema(seed: int, size: int = 55_000) -> dict:
    """A flat object schema of about `size` bytes; a random title defeats every compile cache."""
    rnd = random.Random(seed)
    props: dict[str, dict] = {}
    while len(json.dumps(props)) < size - 300:
        i = len(props)
        props[f"f{i}_{rnd.randrange(10**6)}"] = [
            {"type": "string", "maxLength": 24, "pattern": "^[a-z]{2,8}-[0-9]{1,4}$"},
            {"enum": [f"v{rnd.randrange(10**6)}" for _ in range(6)]},
            {"type": "integer", "minimum": 0, "maximum": rnd.randrange(10, 10**6)},
            {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}][i % 4]
    return {"title": f"t{rnd.randrange(10**12)}", "type": "object", "properties": props,
            "required": list(props)[:8], "additionalProperties": False}


async def _stream(client: httpx.AsyncClient, key: str,
                  started: asyncio.Event) -> tuple[list[float], str, int]:
    """(gaps between chunks, finish reason, tokens) of a 600-token greedy streaming completion."""
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    gaps, finish, tokens, last = [], "", 0, None
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
            if len(gaps) == 5:
                started.set()
    return gaps, finish, tokens


def burst_body(seed: int) -> bytes:
    """Built before the stream starts: making and encoding 55 KB of JSON would stall this test's own loop."""
    return json.dumps({"model": "default", "prompt": [f"record {i} of batch {seed}:" for i in range(16)],
                       "n": 8, "max_tokens": 4, "temperature": 1.0,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": f"s{seed}",
                                                           "schema": big_schema(seed)}}}).encode()


async def _burst(client: httpx.AsyncClient, key: str, body: bytes) -> httpx.Response:
    return await client.post("/v1/completions", content=body,
                             headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def test_a_grammar_burst_does_not_stall_other_streams(stack: GatewayStack) -> None:
    streamer = stack.stack.create_tenant("streamer")
    burster = stack.stack.create_tenant("burster", max_concurrent=64)
    bodies = [burst_body(seed) for seed in range(4)]
    assert all(50_000 < len(b) < 64_000 for b in bodies)

    async def main() -> tuple[tuple[list[float], str, int], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            started = asyncio.Event()
            stream = asyncio.create_task(_stream(client, streamer, started))
            await asyncio.wait_for(started.wait(), 60)
            bursts = await asyncio.gather(*(_burst(client, burster, b) for b in bodies))
            return await stream, bursts

    (gaps, finish, tokens), bursts = asyncio.run(main())
    assert finish == "length" and tokens == STREAM_TOKENS
    assert max(gaps) < 1.0, f"the stream stalled for {max(gaps):.2f} s"
    for resp in bursts:  # every burst request is served, or refused with a clear retryable error
        if resp.status_code != 200:
            assert resp.status_code in (429, 503) and resp.headers.get("retry-after"), resp.text
        else:
            assert len(resp.json()["choices"]) == 16 * 8
    assert any(r.status_code == 200 for r in bursts)
