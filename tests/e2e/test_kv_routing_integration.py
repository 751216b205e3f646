"""Block reports end to end: real worker processes (tiny random model), real ZeroMQ, one Router.

The worker's reported blocks are exactly the gateway's block ids of what it cached; a repeat of a prompt is
predicted to the token (precision 1); a worker with another block size is refused; a SIGKILLed worker
restarted on its port is resynced within 2 s of its first stats frame.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from config.local_stack.launcher import WorkerProc
from router import Membership, Router, RouteRequest, namespace_root
from worker.protocol import SamplingParams, block_ids

SECRET = b"kv-integration"
NS = namespace_root("tiny-random", "v", "tenant-a", SECRET)
READY_S = 240.0


def request(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(rid=rid, ns=NS, tokens=tokens, cost=len(tokens) + 4,
                        sampling=SamplingParams(max_tokens=4, ignore_eos=True), deadline=time.time() + 60)


async def run(router: Router, req: RouteRequest) -> int:
    cached = 0
    async for chunk in router.stream(req):
        cached = max(cached, chunk.cached_tokens)
    return cached


async def until(predicate, timeout: float) -> float:
    """Seconds until `predicate()` held; AssertionError after `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.heavy  # a long multi-process scenario: `make test-heavy`, its own CI step
@pytest.mark.timeout(600)
async def test_reports_predictions_refusal_and_resync(tmp_path: Path) -> None:
    good = WorkerProc(tmp_path, extra=["--stats-interval", "0.05"])
    bad = WorkerProc(tmp_path, extra=["--stats-interval", "0.05", "--block-size", "32"])
    membership = Membership(gateway_id="gw-kv", static_endpoints=[good.endpoint, bad.endpoint],
                            dead_after=2.0)
    try:
        await membership.start()
        await membership.wait_until(lambda m: len(m.live()) == 2, timeout=READY_S)
        router = Router(membership, secret=SECRET)
        index = router.kv.index
        await until(lambda: router.kv.refused(bad.endpoint), 5)
        assert router.live() == [good.endpoint]

        seen: list[tuple[str, int, int]] = []
        router.on_precision(lambda _rid, w, predicted, actual: seen.append((w, predicted, actual)))
        prompt = list(range(1000, 1064)) + [7, 8, 9]  # 4 whole blocks, then a tail
        assert await run(router, request("a", prompt)) == 0
        want = set(block_ids(NS, prompt, 16))  # prefill publishes the 4 whole blocks
        await until(lambda: index.match(list(want), [good.endpoint]) == {good.endpoint: 4}, 5)
        assert await run(router, request("b", prompt[:64] + [5, 6])) == 64
        assert seen[-1] == (good.endpoint, 64, 64)  # predicted exactly
        # a worker recomputes the last prompt token
        assert await run(router, request("b2", prompt[:64])) == 48
        assert seen[-1] == (good.endpoint, 48, 48)
        assert bad.endpoint not in {w for w, _, _ in seen}

        # SIGKILL, restart on the same port: its new epoch starts empty and is synced at once
        port = good.port
        good.proc.kill()
        good.stop()
        await membership.wait_until(lambda m: good.endpoint not in m.live(), timeout=10)
        good = WorkerProc(tmp_path, port=port, extra=["--stats-interval", "0.05"])
        await membership.wait_until(lambda m: good.endpoint in m.live(), timeout=READY_S)
        back_at = time.monotonic()
        await until(lambda: index.synced(good.endpoint) and index.blocks(good.endpoint) == 0, 2.0)
        assert await run(router, request("c", prompt)) == 0  # the restarted worker's cache is empty
        await until(lambda: index.blocks(good.endpoint) == 4, 2.0)
        print(f"resynced and re-indexed {time.monotonic() - back_at:.2f}s after the restart's first stats")
    finally:
        await membership.close()
        good.stop()
        bad.stop()
