"""Tenant isolation on a real stack: caches, routing keys, logs, metrics, keys at rest, disabling.

Against the fault suite's stack (its worker runs WITH the prefix cache): tenant
B sending tenant A's exact prompt gets `cached_tokens == 0` while A's own repeat
is served from the cache; A's and B's cache namespaces and routing keys differ
for the same tokens (their salts come from Redis, never from the client); no
API key appears in the gateway or worker logs (the gateway logs at DEBUG) or in
either `/metrics`, and no prompt text in the logs; Redis holds only key
digests (every key name and value scanned); and disabling a tenant, with
`redis-cli HSET ... status disabled` or `switchyard tenants disable`, ends its
open streams with an SSE `tenant_disabled` error event and turns its new
requests into 401 within 1 s.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
import redis

from router.placement.prefix import namespace_root, prefix_key
from tenancy.apikeys import digest
from tenancy.redis_client import sync_client
from tenancy.schema import api_key_key, config_key
from tenancy.tenant_admin import get_tenant, set_status
from tests import REPO
from tests.faults.client import metric
from tests.faults.conftest import expect_error, gateway_log, post
from tests.gateway_stack import GatewayStack

# generous: the first test also pays for starting the session stack (bounded by its 240 s ready timeout)
pytestmark = pytest.mark.timeout(330)

SECRET = b"switchyard-dev-secret"  # the gateway's default hash_secret
CANARY = "zebra-canary-7f3a"  # prompt text that must never reach a log
# ~190 tokens: several whole KV pages, so a cache hit is visible in cached_tokens
SHARED_PROMPT = ("You are a careful assistant for the accounts team. " * 19
                 + f"Question {CANARY}: what is due?")
LIMIT_S = 1.0  # a disable must take effect within this


@pytest.fixture(scope="module")
def rds(fault_stack: GatewayStack) -> Iterator[redis.Redis]:
    client = sync_client(fault_stack.stack.redis_url)
    yield client
    client.close()


def completion(stack: GatewayStack, key: str, prompt: str | list[int], max_tokens: int = 1) -> dict:
    content = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    resp = post(stack, "/v1/completions", content.encode(), key=key)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def shared_prompt_runs(fault_stack: GatewayStack) -> dict[str, dict]:
    """Tenant A sends the prompt twice, then tenant B sends the same prompt."""
    key_a = fault_stack.stack.create_tenant("iso-a")
    key_b = fault_stack.stack.create_tenant("iso-b")
    runs = {"first": completion(fault_stack, key_a, SHARED_PROMPT)}
    runs["repeat"] = completion(fault_stack, key_a, SHARED_PROMPT)
    runs["other"] = completion(fault_stack, key_b, SHARED_PROMPT)
    return runs


def test_other_tenant_gets_no_cached_tokens(shared_prompt_runs):
    first, other = shared_prompt_runs["first"], shared_prompt_runs["other"]
    assert cached(first) == 0 and first["usage"]["prompt_tokens"] > 100
    assert other["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert cached(other) == 0, "tenant B was served from tenant A's cache"


def test_same_tenant_repeat_is_cached(shared_prompt_runs):
    # proves the cache is on, so B's zero above is isolation, not a cold cache
    repeat, first = shared_prompt_runs["repeat"], shared_prompt_runs["first"]
    assert 0 < cached(repeat) < first["usage"]["prompt_tokens"], \
        "the prefix cache served nothing to A's repeat"


def test_namespaces_and_routing_keys_differ_per_tenant(fault_stack, rds):
    a, b = fault_stack.stack.create_tenant("iso-ra"), fault_stack.stack.create_tenant("iso-rb")
    assert a and b
    salt_a, salt_b = get_tenant(rds, "iso-ra").salt, get_tenant(rds, "iso-rb").salt
    assert salt_a and salt_b and salt_a != salt_b and "iso-r" not in salt_a + salt_b
    tokens = list(range(1000, 1000 + 256))
    ns_a = namespace_root("default", "v1", salt_a, SECRET)
    ns_b = namespace_root("default", "v1", salt_b, SECRET)
    assert ns_a != ns_b
    key_a = prefix_key(tokens, None, root=ns_a, block_size=16)
    key_b = prefix_key(tokens, None, root=ns_b, block_size=16)
    assert key_a is not None and key_b is not None and key_a != key_b
    # same tenant, same tokens: the same key on every gateway replica
    assert key_a == prefix_key(tokens, None, root=namespace_root("default", "v1", salt_a, SECRET),
                               block_size=16)
    # the key of one block differs too (no shared first hop that would place B next to A)
    assert prefix_key(tokens[:16], None, root=ns_a, block_size=16) != \
        prefix_key(tokens[:16], None, root=ns_b, block_size=16)


async def _stream(client: httpx.AsyncClient, key: str,
                  started: asyncio.Event) -> tuple[int, dict | None, float]:
    """One long stream: (content chunks, the error event if any, monotonic time it ended)."""
    body = {"model": "default", "prompt": "Count forever:", "max_tokens": 1900, "ignore_eos": True,
            "stream": True}
    chunks, error = 0, None
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            chunks += 1
            if chunks >= 3:
                started.set()
    return chunks, error, time.monotonic()


async def _first_401(client: httpx.AsyncClient, key: str, deadline: float) -> tuple[httpx.Response, float]:
    """New requests until the first 401 (or the deadline): that response and when it came."""
    body = {"model": "default", "prompt": "hi", "max_tokens": 1}
    while True:
        resp = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
        if resp.status_code == 401 or time.monotonic() > deadline:
            return resp, time.monotonic()
        await asyncio.sleep(0.05)


async def _disable_during_streams(stack: GatewayStack, key: str,
                                  disable: Callable[[], Awaitable[float]]) -> tuple[float, list, tuple]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.ensure_future(_stream(client, key, ev)) for ev in started]
        try:
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
            t0 = await disable()
            refused = await _first_401(client, key, t0 + LIMIT_S + 2)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        finally:
            for t in tasks:
                t.cancel()
    return t0, results, refused


def _check_cut_off(t0: float, results: list, refused: tuple[httpx.Response, float]) -> None:
    for chunks, error, ended in results:
        assert error is not None and error["code"] == "tenant_disabled", error
        assert chunks < 1900, "the stream ran to the end"
        assert ended - t0 < LIMIT_S, f"a stream ran {ended - t0:.2f}s after the disable"
    expect_error(refused[0], 401, "invalid_api_key", None)
    assert refused[1] - t0 < LIMIT_S, f"new requests still served {refused[1] - t0:.2f}s after the disable"


@pytest.fixture(scope="module")
def disabled_key(fault_stack: GatewayStack) -> str:
    return fault_stack.stack.create_tenant("iso-d")


def test_disabled_tenant_streams_end_and_new_requests_401(fault_stack, rds, disabled_key):
    key = disabled_key

    async def hset() -> float:
        rds.hset(config_key("iso-d"), "status", "disabled")  # what `redis-cli HSET` does
        return time.monotonic()

    async def cli() -> float:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "config.cli", "tenants", "disable", "iso-d", "--redis-url",
            fault_stack.stack.redis_url, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, out
        return time.monotonic()

    cut_before = metric(fault_stack.base_url, "switchyard_stream_errors_total", 'status="401"')
    for disable in (hset, cli):
        set_status(rds, "iso-d", active=True)
        time.sleep(0.6)  # the directory cache forgets the disabled state
        t0, results, refused = asyncio.run(_disable_during_streams(fault_stack, key, disable))
        _check_cut_off(t0, results, refused)
    assert fault_stack.stack.procs["gateway"].poll() is None
    # each cut stream is counted once as a stream error (its HTTP status was already 200)
    cut = metric(fault_stack.base_url, "switchyard_stream_errors_total", 'status="401"') - cut_before
    assert cut == 2 * len(results)


def test_revoked_key_streams_end_and_new_requests_401(fault_stack, rds):
    """Revoking a key ends its own in-flight streams within LIMIT_S (it once let them run to the end)."""
    from tenancy import revoke_key

    key = fault_stack.stack.create_tenant("iso-r")

    async def revoke() -> float:
        revoke_key(rds, key)
        return time.monotonic()

    t0, results, refused = asyncio.run(_disable_during_streams(fault_stack, key, revoke))
    for chunks, error, ended in results:
        assert error is not None and error["code"] == "api_key_revoked", error
        assert chunks < 1900, "the stream ran to the end"
        assert ended - t0 < LIMIT_S + 0.5, f"a stream ran {ended - t0:.2f}s after the revocation"
    expect_error(refused[0], 401, "invalid_api_key", None)


def test_expiring_key_streams_end_and_new_requests_401(fault_stack, rds):
    """A key whose `expires_at` passes (an operator's HSET here) ends its in-flight streams like a revoked
    one, within LIMIT_S, and its new requests get the unknown key's 401."""
    key = fault_stack.stack.create_tenant("iso-x")

    async def expire() -> float:
        rds.hset(api_key_key(digest(key)), "expires_at", f"{time.time():.3f}")
        return time.monotonic()

    t0, results, refused = asyncio.run(_disable_during_streams(fault_stack, key, expire))
    for chunks, error, ended in results:
        assert error is not None and error["code"] == "api_key_revoked", error
        assert chunks < 1900, "the stream ran to the end"
        assert ended - t0 < LIMIT_S + 0.5, f"a stream ran {ended - t0:.2f}s after the expiry"
    expect_error(refused[0], 401, "invalid_api_key", None)


# After the disable test (file order), so its error events and 401s are in the logs scanned here.
@pytest.fixture(scope="module")
def all_keys(fault_stack: GatewayStack, disabled_key: str) -> list[str]:
    """Every kind of key: the stack's three tenants, two more that make requests, and the disabled
    tenant's."""
    return [fault_stack.key, fault_stack.limited_key, fault_stack.batch_key,
            *(fault_stack.stack.create_tenant(name) for name in ("iso-log-1", "iso-log-2")), disabled_key]


def test_api_keys_never_in_logs_or_metrics(fault_stack, worker_metrics_port, all_keys):
    keys = all_keys
    for key in keys[3:5]:
        completion(fault_stack, key, f"Say {CANARY} twice", max_tokens=2)
    bad = keys[3][:-4] + "zzzz"  # well-formed, unknown: the failed-auth path logs too
    expect_error(post(fault_stack, "/v1/completions", b"{}", key=bad), 401, "invalid_api_key", None)
    time.sleep(0.3)  # let the last access-log lines reach the files
    logs = {"gateway": gateway_log(fault_stack),
            "worker": (fault_stack.stack.config.log_dir / "worker.log").read_text(errors="replace"),
            "gateway /metrics": httpx.get(fault_stack.base_url + "/metrics", timeout=10).text,
            "worker /metrics": httpx.get(f"http://127.0.0.1:{worker_metrics_port}/metrics", timeout=10).text}
    assert ("switchyard_requests_total" in logs["gateway /metrics"]
            and "POST /v1/completions" in logs["gateway"])
    for where, text in logs.items():
        for key in [*keys, bad]:
            assert key not in text and key[3:] not in text, f"an API key appears in the {where}"
        assert CANARY not in text, f"prompt text appears in the {where}"


def test_keys_at_rest_are_only_digests(rds, all_keys):
    keys = all_keys
    needles = [k.encode() for k in keys] + [k[3:].encode() for k in keys]
    scanned = 0
    for name in rds.scan_iter(count=500):
        scanned += 1
        blobs = [name, *_values(rds, name)]
        assert not any(n in blob for n in needles for blob in blobs), f"a plaintext key is stored in {name!r}"
    assert scanned >= 10
    for key in keys:
        assert rds.exists(api_key_key(digest(key))), "the key's digest record is missing"


def _values(rds: redis.Redis, name: bytes) -> list[bytes]:
    kind = rds.type(name).decode()
    if kind == "string":
        return [rds.get(name) or b""]
    if kind == "hash":
        return [x for kv in rds.hgetall(name).items() for x in kv]
    if kind in ("set",):
        return list(rds.smembers(name))
    if kind == "zset":
        return [m for m, _ in rds.zrange(name, 0, -1, withscores=True)]
    if kind == "list":
        return rds.lrange(name, 0, -1)
    if kind == "stream":
        return [x for _, fields in rds.xrange(name) for kv in fields.items() for x in kv]
    raise AssertionError(f"unexpected Redis type {kind} for {name!r}")
