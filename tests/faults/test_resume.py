"""No stream lost when a worker dies or drains: two workers, one gateway, 8 greedy streams (tiny model, fp32).

SIGKILL of a worker mid-stream, and SIGTERM of one (a drain that hands its streams over): every stream
finishes whole, with the text, finish reason and usage of an undisturbed run, carried on by the other worker.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.faults.client import completion_body, metric
from tests.faults.cluster import FaultCluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]  # long fault scenarios: `make test-heavy`
STREAMS, MAX_TOKENS, PROMPT_LEN = 8, 300, 12


def prompt(i: int) -> list[int]:
    return [500 + (131 * i + 7 * j) % 30_000 for j in range(PROMPT_LEN)]


async def _stream(http: httpx.AsyncClient, base: str, key: str, i: int, progress: list[int]) -> dict:
    """One streaming completion: its text, finish reason, usage and any error event."""
    body = completion_body(prompt(i), MAX_TOKENS)
    text, finish, usage, error = [], None, None, None
    async with http.stream("POST", base + "/v1/completions", json=body,
                           headers={"authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                text.append(choice["text"])
                progress[i] += 1
                finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "finish": finish, "usage": usage, "error": error}


async def _run(cluster: FaultCluster, key: str, disturb: Callable[[], None] | None = None) -> list[dict]:
    return await run_streams(cluster.gateways[0].base_url, key, disturb)


async def run_streams(base: str, key: str, disturb: Callable[[], None] | None = None, streams: int = STREAMS,
                      timeout: float = 120) -> list[dict]:
    """`streams` greedy streams through the gateway at `base`; `disturb()` once every one is under way."""
    progress = [0] * streams
    async with httpx.AsyncClient(timeout=timeout) as http:
        tasks = [asyncio.create_task(_stream(http, base, key, i, progress)) for i in range(streams)]
        if disturb is not None:
            async with asyncio.timeout(timeout / 2):
                while min(progress) < 10:  # every stream well under way
                    await asyncio.sleep(0.01)
            disturb()
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout)


def _assert_whole(got: list[dict], want: list[dict]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["error"] is None, (i, g["error"])
        assert g["finish"] == "length" and g["usage"]["completion_tokens"] == MAX_TOKENS, (i, g)
        assert g["text"] == w["text"], f"stream {i} differs from the undisturbed run"
        assert g["usage"] == w["usage"], (i, g["usage"], w["usage"])


@pytest.fixture(scope="module")
def pair() -> FaultCluster:
    cluster = FaultCluster.start(workers=2, gateways=1,
                                 worker_args=("--no-prefix-cache", "--drain-handoff", "0.5"))
    try:
        yield cluster
    finally:
        cluster.stop()


def test_sigkilled_worker_streams_resume_whole(pair: FaultCluster) -> None:
    key = pair.create_tenant("resume-kill", max_concurrent=100)
    base = pair.gateways[0].base_url
    want = asyncio.run(_run(pair, key))
    resumes0 = metric(base, "switchyard_router_resumes_total", 'reason="worker_lost"')
    got = asyncio.run(_run(pair, key, disturb=pair.workers[0].proc.kill))
    _assert_whole(got, want)
    assert metric(base, "switchyard_router_resumes_total", 'reason="worker_lost"') > resumes0
    assert metric(base, "switchyard_router_resume_gap_seconds_count") > 0
    pair.heal()


def test_drain_hands_streams_over_and_exits_in_seconds(pair: FaultCluster) -> None:
    key = pair.create_tenant("resume-drain", max_concurrent=100)
    base = pair.gateways[0].base_url
    want = asyncio.run(_run(pair, key))
    victim = pair.workers[0]
    resumes0 = metric(base, "switchyard_router_resumes_total", 'reason="drain"')
    times: list[float] = []

    def drain() -> None:  # SIGTERM, and note when the process is gone
        times.append(time.monotonic())
        victim.signal(signal.SIGTERM)
        threading.Thread(target=lambda: (victim.wait(timeout=30), times.append(time.monotonic())),
                         daemon=True).start()

    got = asyncio.run(_run(pair, key, disturb=drain))
    victim.wait(timeout=30)
    _assert_whole(got, want)
    assert metric(base, "switchyard_router_resumes_total", 'reason="drain"') > resumes0
    assert len(times) == 2 and times[1] - times[0] < 5, f"drained in {times[-1] - times[0]:.1f}s"
    pair.heal()
