"""One tenant's structured-output burst beside another tenant's stream, through a CLI-started stack with the
gateway's default liveness settings (`--worker-timeout` 1 s): four completions of 16 prompts x n 8, each with
its own ~55 KB JSON schema, must not stall the worker loop, and the other stream runs on without a 1 s gap."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway_stack import GatewayStack, start_gateway_stack

pytestmark = pytest.mark.timeout(240)
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


@pytest.fixture(scope="module")
def stack() -> Iterator[GatewayStack]:
    gs = start_gateway_stack(worker_model="tiny-random", gateway_args=())  # the gateway's defaults
    try:
        yield gs
    finally:
        gs.stack.stop()


async def _stream(client: httpx.AsyncClient, key: str, started: asyncio.Event) -> tuple[list[float], str, int]:
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
    return json.dumps({"model": "default", "prompt": [f"record {i} of batch {seed}:" for i in range(16)], "n": 8,
                       "max_tokens": 4, "temperature": 1.0,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": f"s{seed}", "schema": big_schema(seed)}}}).encode()


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
