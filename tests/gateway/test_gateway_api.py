"""End-to-end gateway behaviour over HTTP against real redis-server, worker and gateway processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time

import httpx
import pytest

from config.local_stack.launcher import free_port, wait_for_port
from router.links.client import WorkerClient
from tenancy.redis_client import sync_client
from tenancy.tenant_admin import issue_key, revoke_key
from tests.gateway_stack import GatewayStack
from worker.text.tokenizer import load_tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def post(stack: GatewayStack, path: str, body: dict | bytes, key: str | None = None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key or stack.key}", **kw.pop("headers", {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.base_url + path, content=content, headers=headers, timeout=120, **kw)


def chat_body(**kw) -> dict:
    return {"model": "default", "messages": QUESTION, "temperature": 0, "max_tokens": 16, **kw}


def assert_error(resp: httpx.Response, status: int, type_: str, code: str | None = None,
                 param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == type_
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    assert err["message"]
    return err


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


# ------------------------------------------------------------------ basics

def test_health_ready_and_request_id(stack):
    assert httpx.get(stack.base_url + "/health").status_code == 200
    ready = httpx.get(stack.base_url + "/ready")
    assert ready.status_code == 200 and ready.json()["worker"] is True
    assert ready.headers["x-request-id"].startswith("req-")
    mine = httpx.get(stack.base_url + "/health", headers={"x-request-id": "client-id-123"})
    assert mine.headers["x-request-id"] == "client-id-123"


def test_non_streaming_chat_shape_and_usage(stack, tok):
    resp = post(stack, "/v1/chat/completions", chat_body(max_tokens=24))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(tok.apply_chat_template(QUESTION))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_length_finish_counts_tokens(stack, tok):
    prompt = "The quick brown fox"
    resp = post(stack, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 5,
                                           "ignore_eos": True, "temperature": 0, "logprobs": 0})
    body = resp.json()
    assert resp.status_code == 200, body
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 5 and all(x <= 0 for x in lp["token_logprobs"])
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]


def test_token_id_prompt(stack, tok):
    ids = tok.encode("Paris is the capital of")
    resp = post(stack, "/v1/completions",
                {"model": "default", "prompt": ids, "max_tokens": 3, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == len(ids)


# ------------------------------------------------------------------ streaming and stop strings

def test_stream_with_usage_chunk(stack):
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", timeout=120,
                      headers={"authorization": f"Bearer {stack.key}"},
                      json=chat_body(stream=True, stream_options={"include_usage": True})) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text and "\ufffd" not in text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def _greedy(stack: GatewayStack, prompt: str, n: int, **kw) -> dict:
    resp = post(stack, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": n,
                                           "temperature": 0, "ignore_eos": True, **kw})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


STOP_PROMPT = "List the days of the week: Monday, Tuesday,"


@pytest.fixture(scope="module")
def greedy_text(stack) -> str:
    return _greedy(stack, STOP_PROMPT, 12)["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cut_and_finish_stop(stack, greedy_text, stream):
    full = greedy_text
    assert len(full) > 10
    stop = full[4:8]  # a stop string inside the greedy output
    expected = full[: full.find(stop)]
    body = {"model": "default", "prompt": STOP_PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [stop, "never-appears"], "stream": stream}
    if not stream:
        choice = post(stack, "/v1/completions", body).json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    else:
        with httpx.stream("POST", stack.base_url + "/v1/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {stack.key}"}) as resp:
            chunks = [json.loads(e) for e in sse_events(resp)[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    assert stop not in text
    assert text == expected
    assert finish == "stop"


# ------------------------------------------------------------------ errors

def test_auth_errors(stack):
    resp = httpx.post(stack.base_url + "/v1/chat/completions", json=chat_body())
    assert_error(resp, 401, "invalid_request_error", "invalid_api_key")
    resp = post(stack, "/v1/chat/completions", chat_body(), key="sy-not-a-real-key-at-all")
    assert_error(resp, 401, "invalid_request_error", "invalid_api_key")


def test_model_errors(stack):
    assert_error(post(stack, "/v1/chat/completions", chat_body(model="gpt-17")), 404,
                 "invalid_request_error", "model_not_found", "model")
    assert_error(post(stack, "/v1/chat/completions", chat_body(), key=stack.limited_key), 403,
                 "permission_error", "model_not_allowed", "model")


def test_validation_errors(stack, tok):
    assert_error(post(stack, "/v1/chat/completions", chat_body(temperature=5)), 400,
                 "invalid_request_error", param="temperature")
    err = assert_error(post(stack, "/v1/chat/completions", chat_body(n=9)), 400, "invalid_request_error",
                       param="n")
    assert "between 1 and 8" in err["message"]
    assert_error(post(stack, "/v1/chat/completions", b"{not json"), 400, "invalid_request_error")
    assert_error(post(stack, "/v1/completions", {"model": "default", "prompt": [1, 10**9]}), 400,
                 "invalid_request_error", param="prompt")
    ctx = tok.max_context
    long_prompt = {"model": "default", "prompt": [100] * (ctx - 4), "max_tokens": 10}
    assert_error(post(stack, "/v1/completions", long_prompt), 400, "invalid_request_error",
                 "context_length_exceeded")


def test_max_tokens_above_tenant_cap(stack):
    body = {"model": "default", "prompt": "hi", "max_tokens": 5000}
    assert_error(post(stack, "/v1/completions", body), 400, "invalid_request_error", param="max_tokens")


def test_body_over_limit_413(stack):
    big = json.dumps({"model": "default", "prompt": "x" * 1_200_000}).encode()
    assert_error(post(stack, "/v1/completions", big), 413, "invalid_request_error", "request_too_large")

    def chunks():  # no content-length: the limit holds while reading
        for _ in range(40):
            yield b" " * 50_000

    resp = httpx.post(stack.base_url + "/v1/completions", content=chunks(), timeout=60,
                      headers={"authorization": f"Bearer {stack.key}"})
    assert_error(resp, 413, "invalid_request_error", "request_too_large")


def test_rate_limited_429_with_headers(stack):
    key = stack.stack.create_tenant("onerpm", rpm=1)
    body = {"model": "default", "prompt": "hi", "max_tokens": 1}
    ok = post(stack, "/v1/completions", body, key=key)
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "1"
    denied = post(stack, "/v1/completions", body, key=key)
    assert_error(denied, 429, denied.json()["error"]["type"], "rate_limit_exceeded")
    assert float(denied.headers["retry-after"]) > 0 and "x-ratelimit-remaining-requests" in denied.headers


def test_revoked_key_fails_within_one_second(stack):
    r = sync_client(stack.stack.redis_url)
    key = issue_key(r, "acme")
    assert post(stack, "/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 1},
                key=key).status_code == 200  # now cached by the gateway
    revoke_key(r, key)
    revoked_at = time.monotonic()
    while True:
        status = httpx.get(stack.base_url + "/v1/models",
                           headers={"authorization": f"Bearer {key}"}).status_code
        if status == 401:
            break
        assert time.monotonic() - revoked_at < 1.0, "revoked key still accepted after 1 s"
        time.sleep(0.05)
    assert time.monotonic() - revoked_at <= 1.0
    r.close()


def test_503_when_no_live_worker(stack):
    port = free_port()
    dead = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "config.cli", "gateway", "--port", str(port),
                             "--redis-url", stack.stack.redis_url, "--workers", dead],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 60)
        url = f"http://127.0.0.1:{port}"
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 503
        resp = httpx.post(url + "/v1/chat/completions", json=chat_body(),
                          headers={"authorization": f"Bearer {stack.key}"}, timeout=30)
        assert_error(resp, 503, "server_error", "no_live_worker")
        assert int(resp.headers["retry-after"]) >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=15)


# ------------------------------------------------------------------ client disconnect

async def _watch_worker(endpoint: str) -> WorkerClient:
    client = WorkerClient(endpoint, gateway_id=f"test-observer-{time.monotonic_ns()}", worker_timeout=5.0)
    await client.start()
    await client.wait_ready(30)
    return client


async def _kv_free_when(client: WorkerClient, pred, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = client.stats
        if s is not None and pred(s):
            return s.kv_free
        await asyncio.sleep(0.05)
    raise AssertionError(f"worker stats never matched: {client.stats}")


async def test_client_disconnect_aborts_worker_request(stack):
    observer = await _watch_worker(stack.stack.worker_endpoint)
    try:
        idle = await _kv_free_when(observer, lambda s: s.running == 0 and s.queue == 0, 30)
        body = {"model": "default", "prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", stack.base_url + "/v1/completions", json=body,
                                   headers={"authorization": f"Bearer {stack.key}"}) as resp:
                assert resp.status_code == 200
                seen = 0
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break
                await _kv_free_when(observer, lambda s: s.running == 1 and s.kv_free < idle, 10)
        # connection closed mid-stream: the worker must stop and free the request's pages
        freed = await _kv_free_when(observer, lambda s: s.running == 0 and s.kv_free == idle, 5)
        assert freed == idle
    finally:
        await observer.close()


async def test_non_streaming_client_gone_aborts_worker_request(stack):
    observer = await _watch_worker(stack.stack.worker_endpoint)
    try:
        idle = await _kv_free_when(observer, lambda s: s.running == 0 and s.queue == 0, 30)
        body = {"model": "default", "prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "ignore_eos": True,
                "temperature": 0}
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.ensure_future(http.post(stack.base_url + "/v1/completions", json=body,
                                                      headers={"authorization": f"Bearer {stack.key}"}))
            await _kv_free_when(observer, lambda s: s.running == 1 and s.kv_free < idle, 30)
            request.cancel()  # closes the connection with the response still pending
            with contextlib.suppress(asyncio.CancelledError):
                await request
        freed = await _kv_free_when(observer, lambda s: s.running == 0 and s.kv_free == idle, 5)
        assert freed == idle
    finally:
        await observer.close()
