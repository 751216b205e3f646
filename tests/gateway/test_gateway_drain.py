"""Lame-duck shutdown of a real gateway process: SIGTERM with streams open.

A private stack (redis-server, a `tiny-random` worker, a gateway with
`--drain-timeout 30`) gets several long streams; after SIGTERM, `/ready` and new
API requests get 503 `server_shutting_down` with `retry-after`, every open
stream still runs to `[DONE]` with all its tokens, and the gateway exits 0 soon
after the last one. A second gateway on the same worker, with a 1 s grace
period, shows the other side: a stream that outlives the grace is cut, its
worker request is aborted, and the process still exits 0; background responses it
runs end stored as finished or `failed` (never left in progress), their leases gone.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from config.local_stack.launcher import Stack, StackConfig, free_port
from tenancy.schema import leases_key
from tests import REPO

pytestmark = pytest.mark.timeout(180)



@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    logs = Path(tempfile.mkdtemp(prefix="sy-drain-test-"))
    s = Stack(StackConfig(port=free_port(), log_dir=logs, ready_timeout=120.0,
                          worker_args=["--model", "tiny-random", "--no-prefix-cache", "--num-threads", "1",
                                       "--kv-cache-bytes", str(16 << 20), "--metrics-port", str(free_port())],
                          gateway_args=["--drain-timeout", "30"]))
    s.start()
    try:
        yield s
    finally:
        s.stop()


def body(max_tokens: int, speculative: bool = True) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "speculative": speculative}


async def open_stream(client: httpx.AsyncClient, key: str, max_tokens: int, started: asyncio.Event,
                      speculative: bool = True) -> tuple[int, dict | None, bool]:
    """Stream one chat completion: (content chunks, final usage, saw [DONE]); `started` at the first chunk."""
    chunks, usage, done = 0, None, False
    async with client.stream("POST", "/v1/chat/completions", json=body(max_tokens, speculative),
                             headers={"authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-request-id"].startswith("req-")  # the id header is on streams too
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                chunks += bool(event.get("choices"))
        except httpx.HTTPError:
            pass  # cut by the server: reported as done=False
    return chunks, usage, done


async def wait_draining(client: httpx.AsyncClient, deadline_s: float) -> httpx.Response:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        resp = await client.get("/ready")
        if resp.status_code == 503:
            return resp
        await asyncio.sleep(0.05)
    raise AssertionError("gateway never reported draining on /ready")


def spawn_gateway(stack: Stack, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "config.cli", "gateway", "--port", str(port), "--redis-url",
            str(stack.redis_url), "--workers", stack.worker_endpoint, "--worker-timeout", "10", *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


async def wait_ready(client: httpx.AsyncClient, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if (await client.get("/ready")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        await asyncio.sleep(0.1)


async def test_grace_period_over_cuts_stream_aborts_it_and_exits_0(stack: Stack, tmp_path: Path) -> None:
    key = stack.create_tenant("acme")
    port = free_port()
    proc = spawn_gateway(stack, port, ["--drain-timeout", "1"], tmp_path / "gateway.log")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            await wait_ready(client, proc, tmp_path / "gateway.log")
            # six streams of one token per step (the random model's looping text is all accepted drafts
            # otherwise), close to its 2,048 positions: they outlive the 1 s grace however fast the machine is
            events = [asyncio.Event() for _ in range(6)]
            streams = [asyncio.create_task(open_stream(client, key, 1950, e, speculative=False))
                       for e in events]
            async with asyncio.timeout(60):
                for e in events:
                    await e.wait()
            t_signal = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*streams)
        cut = [(chunks, usage) for chunks, usage, done in results if not done]
        assert cut, results
        assert all(usage is None and chunks < 1950 for chunks, usage in cut)
        rc = await asyncio.to_thread(proc.wait, 15)
        assert rc == 0
        assert time.monotonic() - t_signal < 10  # 1 s grace + uvicorn's 2 s hard stop, not the whole stream
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    # the cut stream's worker request was aborted: the worker's KV pages are all free again
    metrics_port = stack.config.worker_args[stack.config.worker_args.index("--metrics-port") + 1]
    async with httpx.AsyncClient(timeout=10) as client:
        deadline = time.monotonic() + 10
        while True:
            page = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            used = next(line for line in page.splitlines()
                        if line.startswith("switchyard_worker_kv_pages_used "))
            if float(used.split()[1]) == 0:
                break
            assert time.monotonic() < deadline, used
            await asyncio.sleep(0.1)


async def test_shutdown_ends_background_responses_and_exits_0(stack: Stack, tmp_path: Path) -> None:
    key = stack.create_tenant("bg-drain")
    port = free_port()
    proc = spawn_gateway(stack, port, ["--drain-timeout", "1"], tmp_path / "gateway.log")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                     headers={"authorization": f"Bearer {key}"}) as client:
            await wait_ready(client, proc, tmp_path / "gateway.log")
            ids = []
            for _ in range(6):
                resp = await client.post("/v1/responses", json={"model": "default",
                                                                "input": "Tell me a long story.",
                                                                "max_output_tokens": 1950,
                                                                "background": True})
                assert resp.status_code == 200 and resp.json()["status"] == "queued", resp.text
                ids.append(resp.json()["id"])
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    r = redis.Redis.from_url(stack.redis_url)
    try:
        ended = [json.loads(r.get(f"{{t:bg-drain}}:resp:{rid}"))["response"] for rid in ids]
        assert r.zcard(leases_key("bg-drain")) == 0  # every run settled its reservation
    finally:
        r.close()
    print("background runs at shutdown:", [e["status"] for e in ended])
    for e in ended:  # finished within the grace, or stopped by the shutdown: never left in progress
        assert e["status"] in ("completed", "incomplete") or (e["status"] == "failed" and "shut down" in
                                                              e["error"]["message"]), e


async def test_sigterm_finishes_open_streams_refuses_new_and_exits_0(stack: Stack) -> None:
    key = stack.create_tenant("acme")
    gateway = stack.procs["gateway"]
    # sized in engine steps, not seconds: 1,000 non-speculative tokens outlast the drain's first exchanges on
    # a fast machine (64 speculative ones did not) and end well inside the 30 s grace on a slow one
    n, max_tokens = 4, 1000
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        events = [asyncio.Event() for _ in range(n)]
        streams = [asyncio.create_task(open_stream(client, key, max_tokens, e, speculative=False))
                   for e in events]
        async with asyncio.timeout(60):
            await asyncio.gather(*(e.wait() for e in events))
        gateway.send_signal(signal.SIGTERM)
        t_signal = time.monotonic()

        ready = await wait_draining(client, 5)
        assert ready.headers["retry-after"] == "1"
        refused = await client.post("/v1/chat/completions", json=body(4),
                                    headers={"authorization": f"Bearer {key}"})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["x-request-id"].startswith("req-")
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.json()["error"]["type"] == "server_error"
        assert not all(s.done() for s in streams), "streams ended before the drain could be observed"

        results = await asyncio.gather(*streams)
    for chunks, usage, done in results:
        assert done and usage is not None
        assert usage["completion_tokens"] == max_tokens
        assert chunks >= 1
    rc = await asyncio.to_thread(gateway.wait, 15)
    assert rc == 0
    # it left once the streams were done, long before the 30 s grace period
    assert time.monotonic() - t_signal < 20
