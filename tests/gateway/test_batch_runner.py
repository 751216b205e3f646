"""Two batch runners over one real Redis: a line claimed by a runner that stops mid-line is reclaimed by the
other once idle past the bound, and every line's output appears exactly once in the output file."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio as aredis

from common.priorities import Priority
from gateway.batches.batch_routes import parse_line
from gateway.batches.batch_runner import BatchRunner, RunnerConfig
from gateway.batches.batch_store import Batch, BatchStore
from gateway.files.file_store import DirectoryFileStore
from gateway.openai.schemas import parse_chat
from gateway.web.api_errors import ApiError


def test_abandoned_line_is_reclaimed_and_answered_once(redis_url, tmp_path):
    asyncio.run(_reclaim(redis_url, tmp_path))


async def _reclaim(redis_url: str, tmp_path) -> None:
    client = aredis.Redis.from_url(redis_url)
    files = DirectoryFileStore(tmp_path)
    staged = files.staging("t")
    raw = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"i": i}}).encode() + b"\n" for i in range(3)]
    staged.write_bytes(b"".join(raw))
    inp = files.put("t", "in.jsonl", "batch", staged)
    store = BatchStore(client)
    now = int(time.time())
    batch = Batch("batch_test1", "/v1/completions", inp.id, "24h", "in_progress", now, now + 86_400, total=3)
    await store.save("t", batch)
    calls: list[tuple[str, int]] = []
    stuck = asyncio.Event()

    async def hang(tenant: str, b: Batch, body: dict) -> tuple[int, dict]:
        calls.append(("a", body["i"]))
        stuck.set()
        await asyncio.sleep(3600)  # the claimer "dies" mid-line
        raise AssertionError

    async def answer(tenant: str, b: Batch, body: dict) -> tuple[int, dict]:
        calls.append(("b", body["i"]))
        return 200, {"echo": body["i"]}

    cfg = RunnerConfig(concurrency=1, claim_idle_s=0.5, block_ms=100, stop_wait_s=0.1)
    a = BatchRunner(store, files, hang, cfg, name="a")
    a.start()
    await store.enqueue("t", batch.id, [0, len(raw[0]), len(raw[0]) + len(raw[1])])
    async with asyncio.timeout(10):
        await stuck.wait()
    await a.stop()  # its line stays claimed and unacknowledged
    b = BatchRunner(store, files, answer, cfg, name="b")
    b.start()
    try:
        async with asyncio.timeout(20):
            while (await store.get("t", batch.id)).status != "completed":
                await asyncio.sleep(0.1)
    finally:
        await b.stop()
    done = await store.get("t", batch.id)
    assert done.counts == {"total": 3, "completed": 3, "failed": 0}
    lines = [json.loads(x) for x in files.content_path("t", done.output_file_id).read_bytes().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["c0", "c1", "c2"]  # each exactly once
    assert [c for c in calls if c[0] == "a"] == [("a", 0)]
    assert sorted(i for who, i in calls if who == "b") == [0, 1, 2]  # line 0 was run again, recorded once
    assert all(x["response"]["status_code"] == 200 for x in lines) and done.error_file_id is None
    await client.aclose()


def test_long_line_keeps_its_claim_and_a_refusal_is_retried(redis_url, tmp_path):
    asyncio.run(_long_and_retried(redis_url, tmp_path))


async def _long_and_retried(redis_url: str, tmp_path) -> None:
    client = aredis.Redis.from_url(redis_url)
    files = DirectoryFileStore(tmp_path)
    staged = files.staging("t")
    staged.write_bytes(json.dumps({"custom_id": "c0", "method": "POST", "url": "/v1/completions",
                                   "body": {}}).encode() + b"\n")
    inp = files.put("t", "in.jsonl", "batch", staged)
    store = BatchStore(client)
    now = int(time.time())
    batch = Batch("batch_test2", "/v1/completions", inp.id, "24h", "in_progress", now, now + 86_400, total=1)
    await store.save("t", batch)
    calls: list[str] = []

    async def slow_then_ok(tenant: str, b: Batch, body: dict) -> tuple[int, dict]:
        calls.append("a")
        await asyncio.sleep(1.5)  # five times the claim bound: the heartbeat keeps the line
        return (503, {"error": {"message": "busy"}}) if len(calls) == 1 else (200, {"ok": True})

    async def other(tenant: str, b: Batch, body: dict) -> tuple[int, dict]:
        calls.append("b")
        return 200, {"ok": "b"}

    cfg = RunnerConfig(concurrency=1, claim_idle_s=0.3, block_ms=100, stop_wait_s=0.1)
    a = BatchRunner(store, files, slow_then_ok, cfg, name="a")
    a.start()
    await store.enqueue("t", batch.id, [0])
    await asyncio.sleep(0.5)  # a holds the line
    b = BatchRunner(store, files, other, cfg, name="b")
    b.start()
    try:
        async with asyncio.timeout(20):
            while (await store.get("t", batch.id)).status != "completed":
                await asyncio.sleep(0.1)
    finally:
        await a.stop()
        await b.stop()
    assert calls == ["a", "a"]  # refused (503) once, tried again; never taken over by b
    out = json.loads(files.content_path("t", (await store.get("t", batch.id)).output_file_id).read_bytes())
    assert out["response"]["body"] == {"ok": True}
    await client.aclose()


def test_an_idle_runner_waits_quietly_on_the_gateway_s_redis_client(redis_url, tmp_path, caplog):
    """Its blocking read stays within the gateway client's read timeout: no error every round."""
    asyncio.run(_idle(redis_url, tmp_path))
    assert not [r for r in caplog.records if r.name == "switchyard.gateway" and r.levelname == "WARNING"]


async def _idle(redis_url: str, tmp_path) -> None:
    from tenancy.redis_client import async_client

    client = async_client(redis_url)
    files = DirectoryFileStore(tmp_path)
    runner = BatchRunner(BatchStore(client), files, None, name="idle")  # type: ignore[arg-type]
    runner.start()
    await asyncio.sleep(2.0)
    await runner.stop()
    await client.aclose()


def test_a_batch_line_is_priced_as_batch_work_and_a_body_cannot_claim_it():
    line = parse_line("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert line.batch_line and line.priority is Priority.BATCH
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": "batch"}
    assert not parse_chat(body).batch_line               # a lower priority asked for: no batch price
    with pytest.raises(ApiError) as exc:
        parse_chat({**body, "batch_line": True})
    assert exc.value.status == 400 and exc.value.param == "batch_line"
