"""Issue 9, case 4: a burst of ten times the cluster's KV capacity in long batch prompts.

The shared cluster holds 3 x 8,192 KV tokens; a batch request of a 1,000-token prompt and 64 new tokens
costs 1,064, so about 23 fit at once and the burst sends 230 at the same moment. First, a baseline:
three interactive clients send short streaming requests one after another and their time to first
token (TTFT) is recorded. Then the same interactive load runs during the burst. What must hold: every
burst request ends (200 with all its tokens, or 503 `server_overloaded` with `retry-after`), the
excess is shed rather than queued, no worker or gateway dies or logs a traceback, and the interactive
TTFT p99 during the burst stays within a bound set by the baseline p99: TTFT_RATIO_BOUND times it, or it
plus TTFT_CONTENTION_S where that is larger (printed with the ratio).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from tests.faults.client import completion_body, metric, p99, stream_completion
from tests.faults.cluster import FaultCluster, unattributed_errors

# a long fault scenario (`make test-heavy`); the timeout includes the shared cluster start-up
pytestmark = [pytest.mark.timeout(480), pytest.mark.heavy]
LONG_PROMPT, BATCH_MAX_TOKENS, BURST = 1000, 64, 230
CHAT_CLIENTS, CHAT_REQUESTS, CHAT_MAX_TOKENS = 3, 8, 8
# Interactive TTFT p99 under the burst may grow at most this much over its same-run baseline. The
# interactive reserve keeps KV room and the scheduler runs decodes first with chunked prefill, so the
# growth is CPU contention: on the 2-core CI box the gateway's one event loop takes in 230 long bodies
# while three workers prefill 1,000-token prompts. Measured: on a loaded box 326 ms -> 2.76 s (ratio
# 8.5); on a quiet box the baseline is far lower while the burst's CPU cost is not (ratio 30.6; on a
# fast quiet box 67 ms -> 2.68 s, ratio 40.2). That cost is roughly a fixed few seconds, so a ratio alone
# grades the baseline's speed, not the protection: the bound is the larger of the two.
TTFT_RATIO_BOUND = 40.0
TTFT_CONTENTION_S = 4.0
TTFT_LOADED_MAX_S = 10.0  # and an absolute cap: admitted interactive requests never wait like shed ones



async def interactive_ttfts(http: httpx.AsyncClient, url: str, key: str, seed: int) -> list[float]:
    async def client(c: int) -> list[float]:
        out = []
        for i in range(CHAT_REQUESTS):
            prompt = [5000 + (seed + 131 * c + 17 * i + j) % 40_000 for j in range(20)]
            res = await stream_completion(http, url, key, completion_body(prompt, CHAT_MAX_TOKENS))
            assert res.outcome == "completed" and res.ttft_s is not None, res
            out.append(res.ttft_s)
        return out

    per_client = await asyncio.gather(*(client(c) for c in range(CHAT_CLIENTS)))
    return [t for ts in per_client for t in ts]


async def batch_request(http: httpx.AsyncClient, url: str, key: str, i: int) -> str:
    prompt = [6000 + (7 * i + j) % 40_000 for j in range(LONG_PROMPT)]
    body = {"model": "default", "prompt": prompt, "max_tokens": BATCH_MAX_TOKENS, "ignore_eos": True}
    resp = await http.post(url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
    if resp.status_code == 200:
        assert resp.json()["usage"]["completion_tokens"] == BATCH_MAX_TOKENS
        return "ok"
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "server_overloaded"
    assert 1 <= int(resp.headers["retry-after"]) <= 60
    return "shed"


async def test_ten_times_capacity_burst_keeps_interactive_ttft(cluster: FaultCluster) -> None:
    chat_key = cluster.create_tenant("ov-chat", tpm=0, rpm=0, max_concurrent=0)
    bulk_key = cluster.create_tenant("ov-bulk", priority="batch", tpm=0, rpm=0, max_concurrent=0)
    gw = cluster.gateways[0]
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=300)) as http:
        baseline = await interactive_ttfts(http, gw.base_url, chat_key, 0)
        start = time.monotonic()
        burst = [asyncio.create_task(batch_request(http, gw.base_url, bulk_key, i)) for i in range(BURST)]
        await asyncio.sleep(0.2)  # the burst is in: admitted ones fill the workers, the rest wait or shed
        loaded = await interactive_ttfts(http, gw.base_url, chat_key, 997)
        overlap_s = time.monotonic() - start
        done, pending = await asyncio.wait(burst, timeout=150)
        assert not pending, f"{len(pending)} burst requests hung"
        burst_s = time.monotonic() - start
    outcomes = Counter(t.result() for t in burst)
    shed = {reason: metric(gw.base_url, "switchyard_shed_total", f'reason="{reason}"')
            for reason in ("capacity", "quota_service_unavailable", "no_worker")}
    base_p99, loaded_p99 = p99(baseline), p99(loaded)
    ratio = loaded_p99 / base_p99
    bound = max(TTFT_RATIO_BOUND * base_p99, base_p99 + TTFT_CONTENTION_S)
    print(f"burst of {BURST}: {dict(outcomes)} in {burst_s:.1f}s; "
          f"interactive TTFT p99 {base_p99 * 1000:.0f} ms baseline, {loaded_p99 * 1000:.0f} ms "
          f"during the burst (measured over its first {overlap_s:.1f}s): "
          f"ratio {ratio:.2f}, bound {bound * 1000:.0f} ms; gateway shed counters {shed}")
    assert outcomes["ok"] >= 15, outcomes  # the capacity that exists is used
    assert outcomes["shed"] >= BURST // 2, outcomes  # the excess is shed, not queued
    assert loaded_p99 <= bound and loaded_p99 <= TTFT_LOADED_MAX_S
    for w in cluster.workers:
        assert w.proc.poll() is None, w.log_text()[-3000:]
        assert "Traceback" not in w.log_text()
    assert gw.proc.poll() is None
    assert unattributed_errors(gw) == []
