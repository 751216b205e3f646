"""Background responses against a real Redis with a stand-in generation: the per-tenant and per-gateway
bounds, a cancel here and from another gateway (its watcher stops the run), shutdown records `failed`, a
finished run refuses a cancel, a lost run reads as failed, a request too large to store never runs, and the
store refuses any end but `cancelled` after a cancel."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from gateway.flow.generation import Delta
from gateway.flow.service import GatewayService
from gateway.openai.bodies import Usage
from gateway.openai.responses_shape import new_shape, parse_responses
from gateway.responses import background
from gateway.responses.background import BackgroundRuns
from gateway.responses.conversations import Conversations
from gateway.responses.response_store import ResponseStore, reported
from gateway.web.api_errors import ApiError
from gateway.web.drain_middleware import DrainState
from tenancy import Tenant
from tenancy.redis_client import async_client


@dataclass(slots=True)
class FakeGen:
    """One delta of text, then (unless `finish`) a wait until cancelled, as a long generation."""

    prepared: SimpleNamespace
    finish: bool = False
    usage: Usage = field(default_factory=lambda: Usage(prompt_tokens=7))
    closed: int = 0
    ticket: None = None
    _sent: bool = False

    async def next(self) -> Delta | None:
        if not self._sent:
            self._sent = True
            self.usage.completion_tokens = 1
            return Delta("Hi", None, "stop" if self.finish else None)
        if self.finish:
            return None
        await asyncio.Event().wait()
        return None

    async def close(self) -> None:
        self.closed += 1


class FakeTrace:
    def first_token(self, completion_tokens: int) -> None:
        pass


@pytest.fixture()
async def store(redis_url):
    client = async_client(redis_url)
    yield ResponseStore(client, ttl_s=60)
    await client.aclose()


def runs_over(store: ResponseStore, drain: DrainState | None = None, **bounds) -> BackgroundRuns:
    """Background runs over `store`, with a service that is never asked to generate (the runs get fakes)."""
    service = GatewayService(None, None, None)  # type: ignore[arg-type]
    return BackgroundRuns(service, Conversations(store), drain or DrainState(), **bounds)


def new_gen(finish: bool = False) -> FakeGen:
    req = parse_responses({"model": "default", "input": "hi", "background": True})
    return FakeGen(SimpleNamespace(shape=new_shape("default", req), tenant=Tenant(name="acme"), req=req),
                   finish)


async def launch(runs: BackgroundRuns, gen: FakeGen) -> str:
    rid = gen.prepared.shape.id
    run = runs.reserve("acme", rid)
    body = await runs.launch(run, gen, FakeTrace(), gen.close)  # type: ignore[arg-type]
    assert body["status"] == "queued" and body["background"] is True
    return rid


async def status_of(store: ResponseStore, rid: str, want: str, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        doc = await store.get("acme", rid)
        if doc["response"]["status"] == want or time.monotonic() > deadline:
            return doc["response"]
        await asyncio.sleep(0.02)


async def test_bounds_per_tenant_and_per_gateway(store):
    drain = DrainState()
    runs = runs_over(store, drain, per_tenant=1, per_gateway=2)
    first = runs.reserve("a", "resp_1")
    with pytest.raises(ApiError) as err:
        runs.reserve("a", "resp_2")
    assert err.value.status == 429 and err.value.param == "background" and err.value.headers["retry-after"]
    runs.reserve("b", "resp_3")
    with pytest.raises(ApiError) as err:
        runs.reserve("c", "resp_4")
    assert err.value.status == 503 and err.value.code == "server_overloaded"
    assert drain.in_flight == 2  # a drain waits for background runs
    runs.release(first)
    runs.release(first)  # once only
    assert drain.in_flight == 1


async def test_cancel_here_is_recorded_with_usage_and_is_idempotent(store):
    drain = DrainState()
    runs = runs_over(store, drain)
    gen = new_gen()
    rid = await launch(runs, gen)
    await status_of(store, rid, "in_progress")
    resp = await runs.cancel("acme", rid)
    assert resp["status"] == "cancelled" and resp["usage"]["output_tokens"] == 1
    assert resp["output"][0]["content"][0]["text"] == "Hi" and resp["output"][0]["status"] == "incomplete"
    assert gen.closed == 1 and drain.in_flight == 0
    assert (await runs.cancel("acme", rid))["status"] == "cancelled"  # a second cancel answers the same
    with pytest.raises(ApiError) as err:
        await runs.cancel("other", rid)  # another tenant's id
    assert err.value.status == 404
    await runs.shutdown()


async def test_cancel_from_another_gateway_stops_the_run(store, monkeypatch):
    monkeypatch.setattr(background, "WATCH_INTERVAL_S", 0.05)
    owner, other = runs_over(store), runs_over(store)
    gen = new_gen()
    rid = await launch(owner, gen)
    await status_of(store, rid, "in_progress")
    assert (await other.cancel("acme", rid))["status"] == "cancelled"  # stored at once by the other gateway
    deadline = time.monotonic() + 5
    while gen.closed == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert gen.closed == 1 and owner.drain.in_flight == 0  # the owner's watcher stopped it
    resp = await status_of(store, rid, "cancelled")
    assert resp["status"] == "cancelled"
    deadline = time.monotonic() + 5
    while (await store.get("acme", rid))["response"]["usage"] is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert (await store.get("acme", rid))["response"]["usage"]["output_tokens"] == 1  # the owner's record
    await owner.shutdown()


async def test_deleting_a_running_response_stops_it(store, monkeypatch):
    monkeypatch.setattr(background, "WATCH_INTERVAL_S", 0.05)
    runs = runs_over(store)
    gen = new_gen()
    rid = await launch(runs, gen)
    await status_of(store, rid, "in_progress")
    assert await store.delete("acme", rid)
    deadline = time.monotonic() + 5
    while gen.closed == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    # not stored again
    assert gen.closed == 1 and runs.drain.in_flight == 0 and await store.get("acme", rid) is None
    await runs.shutdown()


async def test_shutdown_records_failed_and_leaves_no_task(store):
    drain = DrainState()
    runs = runs_over(store, drain)
    gens = [new_gen() for _ in range(3)]
    rids = [await launch(runs, g) for g in gens]
    for rid in rids:
        await status_of(store, rid, "in_progress")
    await runs.shutdown()
    for rid, gen in zip(rids, gens, strict=True):
        resp = (await store.get("acme", rid))["response"]
        assert resp["status"] == "failed" and "shut down" in resp["error"]["message"] and gen.closed == 1
    assert drain.in_flight == 0 and not [t for t in asyncio.all_tasks()
                                         if t.get_name().startswith("background")]


async def test_a_finished_run_refuses_a_cancel_and_a_lost_one_reads_failed(store):
    runs = runs_over(store)
    rid = await launch(runs, new_gen(finish=True))
    resp = await status_of(store, rid, "completed")
    assert resp["output"][0]["content"][0]["text"] == "Hi" and resp["usage"]["total_tokens"] == 8
    with pytest.raises(ApiError) as err:
        await runs.cancel("acme", rid)
    assert err.value.status == 400 and "already completed" in err.value.message
    doc = {"response": {"status": "in_progress"}, "run_deadline": time.time() - 1}
    assert reported(doc)["status"] == "failed"
    await runs.shutdown()


async def test_a_request_too_large_to_store_is_refused_before_it_runs(redis_url):
    client = async_client(redis_url)
    drain = DrainState()
    runs = runs_over(ResponseStore(client, max_bytes=100), drain)
    gen = new_gen()
    with pytest.raises(ApiError) as err:
        await launch(runs, gen)
    assert err.value.status == 400 and err.value.param == "background"
    assert gen.closed == 1 and drain.in_flight == 0
    await client.aclose()


async def test_store_refuses_any_end_but_cancelled_after_a_cancel(store):
    body = {"id": "resp_x", "status": "queued", "output": []}
    assert await store.save("acme", body, [], [], run_deadline=time.time() + 60)
    assert await store.stop_asked([("acme", "resp_x"), ("acme", "resp_gone")]) == [False, True]
    assert await store.save_run("acme", {**body, "status": "in_progress"}, [], [], run_deadline=0,
                                final=False)
    assert await store.cancel_run("acme", "resp_x") == "running"
    assert await store.stop_asked([("acme", "resp_x")]) == [True]
    assert not await store.save_run("acme", {**body, "status": "completed"}, [], [], run_deadline=0,
                                    final=True)
    assert await store.save_run("acme", {**body, "status": "cancelled"}, [], [], run_deadline=0, final=True)
    assert await store.cancel_run("acme", "resp_x") == "cancelled"
    assert (await store.get("acme", "resp_x"))["response"]["status"] == "cancelled"
    assert await store.cancel_run("acme", "resp_none") is None
