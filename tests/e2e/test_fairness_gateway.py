"""Fair share end to end: two tenants of weight 2 and 1 keep a `tiny-random` worker backlogged through
the gateway; the worker's per-key service counters (labelled by the gateway's keyed fairness digest)
must split 2 : 1 within 10 %.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from config.local_stack.launcher import Stack, StackConfig, free_port
from router import fairness_key

# a stack of its own and a long scenario: `make test-heavy`, its own CI step
pytestmark = [pytest.mark.timeout(90), pytest.mark.heavy]
SECRET = b"switchyard-dev-secret"  # the gateway's default hash_secret
UNLIMITED = {"tpm": 0, "rpm": 0, "max_concurrent": 0}
IN_FLIGHT = 8  # per tenant, twice the worker's max_num_seqs: both stay backlogged


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Stack, str]]:
    mport = free_port()
    s = Stack(StackConfig(port=free_port(), log_dir=Path(tempfile.mkdtemp(prefix="sy-fair-test-")),
                          ready_timeout=120.0,
                          worker_args=["--model", "tiny-random", "--num-threads", "1", "--max-num-seqs", "4",
                                       "--metrics-port", str(mport), "--metrics-host", "127.0.0.1"]))
    s.start()
    try:
        yield s, f"http://127.0.0.1:{mport}/metrics"
    finally:
        s.stop()


def service(text: str, tenant: str) -> float:
    label = fairness_key(tenant, SECRET)[:4].hex()
    m = re.search(rf'^switchyard_worker_fair_service_tokens_total{{fkey="{label}"}} (\S+)$', text,
                  re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def backlog(base: str, key: str, until: float, errors: list[str]) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 24,
            "ignore_eos": True}
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:

        async def lane() -> None:
            while time.monotonic() < until:
                r = await client.post(base + "/v1/chat/completions", json=body)
                if r.status_code != 200:
                    errors.append(r.text)

        await asyncio.gather(*(lane() for _ in range(IN_FLIGHT)))


async def measure(base: str, metrics_url: str, keys: dict[str, str]) -> dict[str, float]:
    """Service growth per tenant over a window in which both are backlogged."""
    errors: list[str] = []
    until = time.monotonic() + 14.0
    tasks = [asyncio.create_task(backlog(base, key, until, errors)) for key in keys.values()]
    async with httpx.AsyncClient() as probe:
        await asyncio.sleep(3.0)
        before = (await probe.get(metrics_url)).text
        await asyncio.sleep(9.0)
        after = (await probe.get(metrics_url)).text
    await asyncio.gather(*tasks)
    assert not errors, errors[:3]
    return {t: service(after, t) - service(before, t) for t in keys}


def test_weight_two_tenant_gets_twice_the_service_through_the_gateway(stack: tuple[Stack, str]) -> None:
    s, metrics_url = stack
    keys = {"double": s.create_tenant("double", weight=2, **UNLIMITED),
            "single": s.create_tenant("single", **UNLIMITED)}
    got = asyncio.run(measure(s.base_url, metrics_url, keys))
    assert got["single"] > 500, got  # the window saw real work from both
    assert got["double"] / got["single"] == pytest.approx(2.0, rel=0.1), got
