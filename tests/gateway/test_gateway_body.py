"""Request bodies and response streams against hostile clients: huge token lists, clients not reading."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gateway.web.api_errors import ApiError
from gateway.web.request_io import _decode_json
from gateway.web.sse import SSEResponse

pytestmark = pytest.mark.timeout(30)


def test_a_huge_token_list_is_refused_while_decoding():
    body = bytearray(json.dumps({"model": "m", "prompt": list(range(700_000)), "max_tokens": 5}).encode())
    assert len(body) > 4_000_000
    start = time.perf_counter()
    with pytest.raises(ApiError) as exc:
        _decode_json(body, max_numbers=8192 + 64)
    assert time.perf_counter() - start < 0.05  # stopped after the cap, not after 700,000 numbers
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, "prompt", "context_length_exceeded")
    ok = {"model": "m", "prompt": list(range(8192)), "max_tokens": 5, "temperature": 0.5}
    assert _decode_json(bytearray(json.dumps(ok).encode()), max_numbers=8192 + 64) == ok


async def test_a_client_that_stops_reading_is_cut_after_the_write_deadline():
    closed = asyncio.Event()
    sent: list[dict] = []

    async def body():
        for i in range(1000):
            yield f"data: {i}\n\n".encode()

    async def on_close() -> None:
        closed.set()

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) > 3:  # the socket buffers are full: the client is not reading
            await asyncio.sleep(3600)

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    response = SSEResponse(body(), on_close, write_timeout_s=0.2)
    start = time.monotonic()
    await asyncio.wait_for(response({"type": "http", "method": "GET"}, receive, send), 5)
    assert 0.2 <= time.monotonic() - start < 1.0
    assert closed.is_set() and len(sent) == 4


def test_the_number_cap_counts_what_a_valid_body_can_hold():
    """Two prompts of 4,500 ids each fit an 8,192-token context: the body's number cap once counted them
    together (and logit_bias and schema numbers too) and refused them as context_length_exceeded."""
    from gateway.openai.schemas import MAX_LOGIT_BIAS, body_number_cap

    cap = body_number_cap(8192)
    body = {"model": "m", "prompt": [list(range(4500)), list(range(4500))], "max_tokens": 5,
            "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)},
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": i, "maximum": i + 9}
                                                 for i in range(500)}}}}}
    assert _decode_json(bytearray(json.dumps(body).encode()), max_numbers=cap) == body
    with pytest.raises(ApiError):  # a body no valid request could be still stops early
        _decode_json(bytearray(json.dumps({"prompt": list(range(cap + 1))}).encode()), max_numbers=cap)
