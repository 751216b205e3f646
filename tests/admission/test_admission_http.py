"""Issue 6 acceptance through HTTP: refunds, rejected requests, retry-after, leaked leases, Redis outages
and the `openai` SDK, against real gateway processes, a tiny-model worker and a private Redis.

One stack per module: two gateways (the second is SIGKILLed by one test) with a 3 s lease TTL. Bucket
levels are read from Redis and brought to the Redis clock (`tok + elapsed x tpm / 60 s`), so the
token arithmetic is exact. The Redis outage test runs last: it stops and restarts the module's Redis.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tenancy.redis_client import sync_client
from tenancy.schema import bucket_key, leases_key
from tests import REPO
from tests.admission_stack import AdmissionStack, bucket_level, redis_now_us, set_bucket

pytestmark = pytest.mark.timeout(90)
LEASE_TTL_S = 3.0
PROMPT = list(range(100, 120))  # 20 token ids: the prompt cost is exact


@pytest.fixture(scope="module")
def stack() -> Iterator[AdmissionStack]:
    s = AdmissionStack.start(gateways=2,
                             gateway_settings={"lease_ttl": LEASE_TTL_S, "admission_wait_ms": 1000})
    try:
        s.warm_up(50)
        yield s
    finally:
        s.stop()


@pytest.fixture()
def r(stack):
    client = sync_client(stack.redis.url)
    yield client
    client.close()


def complete(base_url: str, key: str, timeout: float = 30, **body) -> httpx.Response:
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 1, "ignore_eos": True, "temperature": 0,
            **body}
    return httpx.post(base_url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=timeout)


def test_refund_through_http(stack, r):
    tpm = 100_000
    key = stack.create_tenant("refund", tpm=tpm, rpm=0, max_concurrent=0)
    gw = stack.gateways[0].base_url
    first = complete(gw, key, max_tokens=10)
    assert first.status_code == 200, first.text
    text10 = first.json()["choices"][0]["text"]
    assert text10.strip(), "greedy text of the first 10 tokens is needed as a stop string"
    set_bucket(r, "refund", 50_000, 0)  # below full, so the refill during the request cannot clamp
    level0, t0 = bucket_level(r, "refund", tpm)
    # the same greedy continuation, stopped by its own first 10 tokens' text: reserves 20 + 500
    resp = complete(gw, key, max_tokens=500, stop=[text10])
    level1, t1 = bucket_level(r, "refund", tpm)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["choices"][0]["finish_reason"] == "stop"
    used = data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]
    assert data["usage"]["prompt_tokens"] == 20 and 10 <= data["usage"]["completion_tokens"] <= 12
    refill = (t1 - t0) * tpm / 60e6
    assert level1 == pytest.approx(level0 + refill - used, abs=1.0)  # 520 reserved, the unused ~490 refunded
    assert r.zcard(leases_key("refund")) == 0


def test_rejected_request_charges_nothing(stack, r):
    key = stack.create_tenant("reject", tpm=6000, rpm=100, max_concurrent=10)
    set_bucket(r, "reject", 50, 100)  # fewer tokens than the request's 20 + 100
    before = r.hgetall(bucket_key("reject"))
    resp = complete(stack.gateways[0].base_url, key, max_tokens=100)
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.hgetall(bucket_key("reject")) == before  # not one token, request or timestamp written
    assert r.zcard(leases_key("reject")) == 0
    assert int(resp.headers["x-ratelimit-remaining-tokens"]) < 120


def test_invalid_requests_cost_a_request_each_then_429_before_parsing(stack, r):
    """M1: a request refused as invalid after authentication charges one request of the tenant's per-minute
    limit (no tokens); once none is left, that gateway answers the tenant 429 before parsing anything."""
    key = stack.create_tenant("invalid", tpm=6000, rpm=3, max_concurrent=10)
    gw = stack.gateways[0].base_url
    set_bucket(r, "invalid", 6000, 3)
    for left in (2, 1, 0):
        bad = complete(gw, key, temperature="hot")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text
        tok, req = (float(v) for v in r.hmget(bucket_key("invalid"), "tok", "req"))
        assert left <= req < left + 0.1 and tok == pytest.approx(6000)  # one request each, not one token
    refused = complete(gw, key, temperature="hot")  # refused before parsing: not a 400 about temperature
    assert (refused.status_code == 429
            and refused.json()["error"]["code"] == "rate_limit_exceeded"), refused.text
    assert "invalid requests" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 21
    assert complete(gw, key).status_code == 429  # a valid request too: the minute's requests are gone
    assert r.zcard(leases_key("invalid")) == 0


def test_retry_after_is_honoured(stack, r):
    tpm = 3000  # 50 tokens/s
    key = stack.create_tenant("retry", tpm=tpm, rpm=0, max_concurrent=0)
    gw = stack.gateways[0].base_url
    prompt = list(range(200, 299))  # 99 + max_tokens 1 = 100 tokens, all used (no refund)
    set_bucket(r, "retry", 0, 0)
    denied = complete(gw, key, prompt=prompt)
    got_at = time.monotonic()
    assert denied.status_code == 429, denied.text
    wait_s = int(denied.headers["retry-after-ms"]) / 1000
    assert 1.6 <= wait_s <= 2.01  # 100 tokens at 50/s, computed from the refill, not a constant
    assert denied.headers["retry-after"] == "2"
    time.sleep(max(0.0, got_at + 0.5 * wait_s - time.monotonic()))
    early = complete(gw, key, prompt=prompt)
    assert early.status_code == 429  # half way is too early, and the retry-after says what is left
    assert 0 < int(early.headers["retry-after-ms"]) / 1000 <= 0.75 * wait_s  # what is left, not a constant
    time.sleep(max(0.0, got_at + 1.1 * wait_s - time.monotonic()))
    ok = complete(gw, key, prompt=prompt)
    assert ok.status_code == 200, ok.text


def test_openai_sdk_sees_rate_limit_error(stack, r):
    key = stack.create_tenant("sdk429", tpm=0, rpm=1, max_concurrent=0)
    client = openai.OpenAI(api_key=key, base_url=stack.gateways[0].base_url + "/v1", max_retries=0,
                           timeout=30)
    client.completions.create(model="default", prompt="Hello", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as exc:
        client.completions.create(model="default", prompt="Hello", max_tokens=1)
    assert exc.value.status_code == 429
    assert float(exc.value.response.headers["retry-after-ms"]) > 0


KILLED_CLIENTS = textwrap.dedent("""
    import asyncio, sys, httpx
    url, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    body = {"model": "default", "prompt": list(range(100, 120)), "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    async def one(http, started):
        async with http.stream("POST", url + "/v1/completions", json=body,
                               headers={"authorization": "Bearer " + key}) as resp:
            assert resp.status_code == 200, resp.status_code
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    started.release()
                    await asyncio.sleep(3600)  # hold the stream open until killed
    async def main():
        started = asyncio.Semaphore(0)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as http:
            tasks = [asyncio.create_task(one(http, started)) for _ in range(n)]
            for _ in range(n):
                await started.acquire()
            print("streaming", flush=True)
            await asyncio.gather(*tasks)
    asyncio.run(main())
""")


def test_killed_streaming_clients_leave_no_leases(stack, r):
    n = 50
    key = stack.create_tenant("killed", tpm=0, rpm=0, max_concurrent=n + 5)
    child = subprocess.Popen([sys.executable, "-c", KILLED_CLIENTS, stack.gateways[0].base_url, key, str(n)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _readline(child, timeout=60)
        assert line.strip() == "streaming", child.stderr.read() if child.poll() is not None else line
        assert r.zcard(leases_key("killed")) == n
        child.kill()
        child.wait(timeout=5)
        killed_at = time.monotonic()
        while r.zcard(leases_key("killed")) and time.monotonic() - killed_at < 2.0:
            time.sleep(0.02)
        assert r.zcard(leases_key("killed")) == 0, "leases still held 2 s after the clients died"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=5)
        child.stdout.close()
        child.stderr.close()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line from `proc`, or '' when it exits or `timeout` passes (never blocks longer)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        return proc.stdout.readline() if sel.select(timeout) else ""
    finally:
        sel.close()


async def test_sigkilled_gateway_leases_expire_within_ttl(stack, r):
    limit = 4
    key = stack.create_tenant("crash", tpm=0, rpm=0, max_concurrent=limit)
    victim, survivor = stack.gateways[1], stack.gateways[0]
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=30) as http:
        started = asyncio.Semaphore(0)
        streams = [asyncio.create_task(_hold_stream(http, victim.base_url, key, body, started))
                   for _ in range(limit)]
        async with asyncio.timeout(30):  # every stream is running (first token read) and holds its lease
            for _ in range(limit):
                await started.acquire()
        assert r.zcard(leases_key("crash")) == limit
        victim.kill()
        killed_at, killed_redis_us = time.monotonic(), redis_now_us(r)
        async with asyncio.timeout(30):
            ended_normally = await asyncio.gather(*streams)
    assert not any(ended_normally), "a stream finished before the gateway was killed"
    # the leases outlive their gateway, but never by more than one TTL (renewal extends by one TTL)
    deadlines = [score for _, score in r.zrange(leases_key("crash"), 0, -1, withscores=True)]
    assert len(deadlines) == limit
    assert max(deadlines) <= killed_redis_us + LEASE_TTL_S * 1e6 + 50_000  # scores: Redis-clock microseconds
    held = complete(survivor.base_url, key)
    assert held.status_code == 429 and "concurrent" in held.json()["error"]["message"]
    while True:
        resp = await asyncio.to_thread(complete, survivor.base_url, key)
        if resp.status_code == 200:
            break
        assert time.monotonic() - killed_at < LEASE_TTL_S + 1.0, "leases of the dead gateway did not expire"
        await asyncio.sleep(0.1)
    assert time.monotonic() - killed_at <= LEASE_TTL_S + 1.0


async def _hold_stream(http: httpx.AsyncClient, base_url: str, key: str, body: dict,
                       started: asyncio.Semaphore) -> bool:
    """Read one stream to its end, releasing `started` at its first event, and keep the connection open
    meanwhile (closing it early would let the gateway settle the lease); True when it ended with
    `[DONE]`, False when the connection dropped (the gateway was killed)."""
    first = True
    try:
        async with http.stream("POST", base_url + "/v1/completions", json=body,
                               headers={"authorization": f"Bearer {key}"}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and first:
                    first = False
                    started.release()
                if line == "data: [DONE]":
                    return True
    except httpx.HTTPError:
        pass
    return False


def test_redis_outage_fails_closed_then_recovers(stack, r):
    """Last in the module: stops and restarts the module's Redis (its data kept in a dump file)."""
    key = stack.create_tenant("outage", tpm=0, rpm=0, max_concurrent=0)
    gw = stack.gateways[0]
    assert complete(gw.base_url, key).status_code == 200
    sdk = {n: openai.OpenAI(api_key=key, base_url=gw.base_url + "/v1", max_retries=n, timeout=30)
           for n in (0, 1)}
    stack.redis.stop()
    try:
        start = time.monotonic()
        resp = complete(gw.base_url, key, timeout=10)
        assert time.monotonic() - start < 3.0  # fails fast: no hang until the request timeout
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "quota_service_unavailable"
        advertised = float(resp.headers.get("retry-after-ms", 1000 * int(resp.headers["retry-after"]))) / 1000
        elapsed = {}
        for n, client in sdk.items():
            start = time.monotonic()
            with pytest.raises(openai.InternalServerError) as exc:
                client.completions.create(model="default", prompt="Hello", max_tokens=1)
            elapsed[n] = time.monotonic() - start
            assert exc.value.status_code == 503
        # the SDK retried once, after the advertised delay (plus one fast failure)
        assert 0.9 * advertised <= elapsed[1] - elapsed[0] <= 1.1 * advertised + 0.3
    finally:
        stack.redis.start()
    assert gw.proc.poll() is None
    deadline = time.monotonic() + 10
    while (resp := complete(gw.base_url, key)).status_code != 200:
        assert time.monotonic() < deadline, f"not admitted again after Redis came back: {resp.text}"
        time.sleep(0.2)


@pytest.mark.parametrize("n", [1, 2])
def test_lease_is_released_before_the_client_sees_the_end(stack, r, n):
    """A client that sends its next request as soon as it reads the last finish_reason (the stream still open)
    is never refused for concurrency: the lease goes before the final chunk does."""
    key = stack.create_tenant(f"lease-race-{n}", tpm=0, rpm=0, max_concurrent=1)
    base, auth = stack.gateways[0].base_url, {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=30) as http, httpx.Client(timeout=30) as other:
        for i in range(10):
            body = {"model": "default", "prompt": [1, 2, 3, i], "max_tokens": 4, "ignore_eos": True, "n": n,
                    "stream": True}
            with http.stream("POST", base + "/v1/completions", json=body, headers=auth) as resp:
                assert resp.status_code == 200
                finished = 0
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        finished += sum(c.get("finish_reason") is not None
                                        for c in json.loads(line[6:])["choices"])
                    if finished == n:
                        break
                nxt = other.post(base + "/v1/completions", headers=auth,
                                 json={"model": "default", "prompt": [4, 5, i], "max_tokens": 1})
                assert nxt.status_code == 200, nxt.text
