"""Acceptance tests of the worker process over ZeroMQ: real processes, real sockets, real Redis, real models.

One shared `tiny-random` worker serves the streaming, abort, garbage, deadline and dead-gateway tests; drain,
SIGKILL-expiry and the 32-request default-model test start their own. Every wait has a deadline and every
process is stopped in a `finally`.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgpack
import pytest
import redis
import zmq
import zmq.asyncio

from common.worker_registry import parse_registration, registration_key
from config.local_stack.launcher import WorkerProc
from router.links.client import WorkerClient, WorkerError
from tests import REPO
from worker import protocol as p
from worker.protocol import SamplingParams
from worker.server.process.registry import REGISTRATION_TTL_MS

pytestmark = pytest.mark.timeout(180)

READY_TIMEOUT = 90.0
LONG = SamplingParams(max_tokens=400, ignore_eos=True)  # outlives the test's actions on the tiny model


@pytest.fixture(scope="module")
def tiny_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProc]:
    proc = WorkerProc(tmp_path_factory.mktemp("tiny"), extra=["--gateway-timeout", "1.5"])
    try:
        yield proc
    finally:
        proc.stop()


async def _client(endpoint: str, name: str, ctx: zmq.asyncio.Context | None = None) -> WorkerClient:
    client = WorkerClient(endpoint, gateway_id=f"{name}-{time.monotonic_ns()}", context=ctx,
                          inter_token_timeout=30.0, worker_timeout=3.0, heartbeat_interval=0.5)
    await client.start()
    await client.wait_ready(READY_TIMEOUT)
    return client


@pytest.fixture()
async def tiny(tiny_worker: WorkerProc) -> AsyncIterator[WorkerClient]:
    try:
        client = await _client(tiny_worker.endpoint, "t")
    except WorkerError:
        pytest.fail("worker not ready:\n" + tiny_worker.log_text())
    try:
        yield client
    finally:
        await client.close()


async def collect(client: WorkerClient, rid: str, tokens: list[int],
                  sampling: SamplingParams) -> tuple[list[int], str]:
    out: list[int] = []
    finish = ""
    async for chunk in client.generate(rid, b"ns", tokens, sampling):
        out.extend(chunk.tokens)
        finish = chunk.finish_reason or finish
    return out, finish


async def wait_stats(client: WorkerClient, pred: object, timeout: float) -> p.WorkerStats:
    async with asyncio.timeout(timeout):
        while True:
            s = client.stats
            if s is not None and pred(s):  # type: ignore[operator]
                return s
            await asyncio.sleep(0.05)


def idle(s: p.WorkerStats) -> bool:
    return s.running == 0 and s.queue == 0


async def test_stream_and_abort_frees_pages(tiny: WorkerClient) -> None:
    idle_stats = await wait_stats(tiny, idle, 10)
    tokens, finish = await asyncio.wait_for(collect(tiny, "a1", [1, 2, 3, 4, 5],
                                                    SamplingParams(max_tokens=5, ignore_eos=True)), 30)
    assert len(tokens) == 5 and finish == "length"

    got = 0
    finish = None
    async with asyncio.timeout(30):
        async for chunk in tiny.generate("a2", b"ns", list(range(10, 60)), LONG):
            got += len(chunk.tokens)
            if got >= 2 and finish is None:
                await tiny.abort("a2")
                finish = "asked"
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
    assert finish == "abort" and got < LONG.max_tokens
    back = await wait_stats(tiny, lambda s: idle(s) and s.kv_free == idle_stats.kv_free, 10)
    assert back.kv_free == idle_stats.kv_free


async def test_garbage_frames_get_err_or_drop_and_worker_keeps_serving(tiny_worker: WorkerProc,
                                                                       tiny: WorkerClient) -> None:
    good = asyncio.create_task(collect(tiny, "keep", [7, 8, 9],
                                       SamplingParams(max_tokens=60, ignore_eos=True)))
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(tiny_worker.endpoint)
    gen = {"t": "gen", "rid": "g", "ns": b"", "tokens": p.pack_tokens([1, 2]), "sampling": {},
           "priority": 0, "deadline": 0.0}

    def bad(rid: str, **over: object) -> bytes:
        frame = dict(gen, rid=rid, **over)
        return msgpack.packb({k: v for k, v in frame.items() if v is not None}, use_bin_type=True)

    expected = {
        "unknown-t": bad("unknown-t", t="launch"), "missing": bad("missing", tokens=None),
        "wrong-type": bad("wrong-type", tokens=[1, 2, 3]),
        "huge": bad("huge", tokens=p.pack_tokens([5] * 20_000)),  # past the 8192-token context
        "neg-max": bad("neg-max", sampling={"max_tokens": -3}),
        "bad-sampling-key": bad("bad-sampling-key", sampling={"nonsense": 1}),
        "bad-token-id": bad("bad-token-id", tokens=p.pack_tokens([1, 10_000_000])),
        "bad-priority": bad("bad-priority", priority="high"),
    }
    try:
        for junk in (b"\xc1\xc1 not msgpack", b"", msgpack.packb([1, 2]), msgpack.packb({"t": "gen"})):
            await raw.send(junk)  # no usable rid: dropped with a log line
        await raw.send_multipart([b"two", b"parts"])
        for frame in expected.values():
            await raw.send(frame)
        errs: dict[str, p.ErrFrame] = {}
        async with asyncio.timeout(15):
            while len(errs) < len(expected):
                frame = p.decode_worker_frame(await raw.recv())
                if isinstance(frame, p.ErrFrame):
                    errs[frame.rid] = frame
        assert set(errs) == set(expected)
        assert all(e.code == "bad_request" and not e.retryable for e in errs.values())
        assert "max_tokens" in errs["neg-max"].message
        tokens, finish = await asyncio.wait_for(good, 60)
        assert len(tokens) == 60 and finish == "length"
        assert tiny_worker.proc.poll() is None
        again, _ = await asyncio.wait_for(collect(tiny, "after", [7, 8, 9], SamplingParams(max_tokens=3)), 30)
        assert len(again) >= 1
    finally:
        raw.close()
        ctx.term()
    assert "not valid msgpack" in tiny_worker.log_text()


async def test_deadline_ends_request_with_retryable_capacity(tiny: WorkerClient) -> None:
    start = time.time()
    with pytest.raises(WorkerError) as info:
        async with asyncio.timeout(20):
            async for _ in tiny.generate("dl", b"", [3, 4], SamplingParams(max_tokens=2040, ignore_eos=True),
                                         deadline=time.time() + 0.3):
                pass
    assert info.value.code == "capacity" and info.value.retryable
    assert "deadline" in info.value.message
    assert time.time() - start < 5
    await wait_stats(tiny, idle, 10)


GATEWAY_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from router.links.client import WorkerClient
    from worker.protocol import SamplingParams

    async def main():
        c = WorkerClient(sys.argv[1], gateway_id=sys.argv[2])
        await c.start()
        await c.wait_ready(60)
        async def one(i):
            async for _ in c.generate(f"k{i}", b"", [5, 6, 7],
                                      SamplingParams(max_tokens=2000, ignore_eos=True)):
                print("tok", flush=True)
        await asyncio.gather(*(one(i) for i in range(3)))

    asyncio.run(main())
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_lost_gateway_leaves_no_running_work(tiny_worker: WorkerProc, tiny: WorkerClient,
                                                   sig: int) -> None:
    """SIGKILL closes the TCP link (the worker notices at once); SIGSTOP leaves it open (the timeout path)."""
    idle_stats = await wait_stats(tiny, idle, 10)
    gateway_id = f"doomed-{sig.name if hasattr(sig, 'name') else sig}-{time.monotonic_ns()}"
    gw = subprocess.Popen([sys.executable, "-c", GATEWAY_SCRIPT, tiny_worker.endpoint, gateway_id], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(gw.stdout.readline), 60)
        assert line.strip() == b"tok"
        await wait_stats(tiny, lambda s: s.running + s.queue >= 3, 10)
        gw.send_signal(sig)
        killed_at = time.monotonic()
        back = await wait_stats(tiny, lambda s: idle(s) and s.kv_free == idle_stats.kv_free, 15)
        assert back.running == 0
        assert time.monotonic() - killed_at < 1.5 + 5  # gateway timeout + housekeeping slack
        how = "disconnected" if sig == signal.SIGKILL else "silent for"
        ending = "aborting its 3 requests" if sig == signal.SIGKILL \
            else "ending its 3 requests with a retryable error"
        assert any(gateway_id in line and how in line and ending in line
                   for line in tiny_worker.log_text().splitlines())
    finally:
        if gw.poll() is None:
            gw.kill()  # also ends a stopped process
            gw.wait(timeout=10)
        gw.stdout.close()


@pytest.mark.heavy  # a long multi-process scenario: `make test-heavy`, its own CI step
async def test_sigterm_drains_running_streams(tmp_path: Path, redis_url: str) -> None:
    # streams finish in place (--drain-handoff -1); the hand-off to other workers: tests/faults/test_resume.py
    worker = WorkerProc(tmp_path, redis_url=redis_url, worker_id="drainer",
                        extra=["--drain-timeout", "60", "--drain-handoff", "-1"])
    r = redis.Redis.from_url(redis_url)
    client = None
    try:
        client = await _client(worker.endpoint, "d")
        reg = parse_registration(r.get(registration_key("drainer")))
        assert reg.endpoint == worker.endpoint and reg.version == p.PROTOCOL_VERSION
        assert reg.engine == "switchyard"
        first_token = [asyncio.Event() for _ in range(8)]

        async def stream(i: int) -> tuple[int, str | None]:
            n, finish = 0, None
            async for chunk in client.generate(f"s{i}", b"", [11, 12, 13 + i],
                                               SamplingParams(max_tokens=600, ignore_eos=True)):
                n += len(chunk.tokens)
                first_token[i].set()
                finish = chunk.finish_reason
            return n, finish

        tasks = [asyncio.create_task(stream(i)) for i in range(8)]
        async with asyncio.timeout(60):
            for ev in first_token:
                await ev.wait()
        worker.signal(signal.SIGTERM)
        await wait_stats(client, lambda s: s.draining, 10)
        with pytest.raises(WorkerError) as info:
            await asyncio.wait_for(collect(client, "late", [1, 2], SamplingParams(max_tokens=2)), 10)
        assert info.value.code == "capacity" and info.value.retryable and "draining" in info.value.message
        results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
        assert results == [(600, "length")] * 8
        assert await asyncio.to_thread(worker.wait, 30) == 0
        assert r.get(registration_key("drainer")) is None
    finally:
        if client is not None:
            await client.close()
        worker.stop()
        r.close()


@pytest.mark.heavy  # a long multi-process scenario: `make test-heavy`, its own CI step
def test_registration_expires_after_sigkill(tmp_path: Path, redis_url: str) -> None:
    worker = WorkerProc(tmp_path, redis_url=redis_url, worker_id="victim")
    r = redis.Redis.from_url(redis_url)
    key = registration_key("victim")
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while r.get(key) is None:
            assert time.monotonic() < deadline, worker.log_text()
            assert worker.proc.poll() is None, worker.log_text()
            time.sleep(0.1)
        time.sleep(1.5)  # outlive one refresh: the key must still be there
        assert r.pttl(key) > REGISTRATION_TTL_MS - 2000
        worker.proc.kill()
        worker.proc.wait(timeout=10)
        killed_at = time.monotonic()
        while r.get(key) is not None:
            assert time.monotonic() - killed_at < REGISTRATION_TTL_MS / 1000 + 1.0
            time.sleep(0.1)
    finally:
        worker.stop()
        r.close()


def _reference_tokens(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the same prompts from an in-process engine (same model, dtype and block size)."""
    import torch

    from worker.config import EngineConfig
    from worker.engine.core import Engine
    from worker.model.loader import load_model

    torch.set_num_threads(1)
    engine = Engine(load_model("default", dtype="float32"),
                    EngineConfig(dtype="float32", kv_cache_bytes=64 << 20))
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens))


@pytest.mark.heavy  # quality gate / default-model end to end: `make test-heavy`, its own CI step
async def test_32_concurrent_default_model_match_in_process_engine(tmp_path: Path) -> None:
    from worker.text.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    prompts = [tok.apply_chat_template([{"role": "user",
                                         "content": f"Tell me fact number {i} about {topic}."}])
               for i, topic in enumerate(["the sea", "Paris", "cats", "trains"] * 8)]
    worker = WorkerProc(tmp_path, model="default", extra=["--dtype", "float32"])
    client = None
    try:
        expected = await asyncio.to_thread(_reference_tokens, prompts, 16)  # while the worker loads
        try:
            client = await _client(worker.endpoint, "c32")
        except WorkerError:
            pytest.fail("worker not ready:\n" + worker.log_text())
        results = await asyncio.wait_for(asyncio.gather(
            *(collect(client, f"q{i}", pr, SamplingParams(max_tokens=16))
              for i, pr in enumerate(prompts))), 150)
        assert [toks for toks, _ in results] == expected
        assert all(finish in ("stop", "length") for _, finish in results)
        assert all(len(toks) == 16 for toks, finish in results if finish == "length")
    finally:
        if client is not None:
            await client.close()
        worker.stop()
