"""`--fail-open` through HTTP: with Redis down a gateway admits up to its own share of a tenant's
limits (the tenant's limits divided by the live gateways it last counted), then answers 429; once
Redis is back the shared Redis budget applies again without a restart."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.admission_stack import AdmissionStack

pytestmark = pytest.mark.timeout(120)
RPM = 4  # one gateway: its local share during the outage is the whole 4 requests/min


@pytest.fixture(scope="module")
def stack() -> Iterator[AdmissionStack]:
    s = AdmissionStack.start(gateways=1, gateway_settings={"fail_open": True, "admission_wait_ms": 1000})
    try:
        yield s
    finally:
        s.stop()


def complete(base_url: str, key: str) -> httpx.Response:
    body = {"model": "default", "prompt": [100, 101, 102], "max_tokens": 1, "ignore_eos": True}
    return httpx.post(base_url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=30)


def test_fail_open_admits_the_local_share_then_429(stack):
    key = stack.create_tenant("open", tpm=0, rpm=RPM, max_concurrent=0)
    gw = stack.gateways[0]
    assert complete(gw.base_url, key).status_code == 200  # the gateway now knows the key and tenant
    stack.redis.stop()
    try:
        statuses = [complete(gw.base_url, key).status_code for _ in range(RPM + 2)]
    finally:
        stack.redis.start()
    # the local bucket is this gateway's share (RPM / 1 live gateway) less what it spent through Redis (1)
    assert statuses[:RPM - 1] == [200] * (RPM - 1), statuses
    assert statuses[RPM - 1:] == [429, 429, 429], statuses
    assert gw.proc.poll() is None
    # Redis back: the shared bucket (1 of 4 used before the outage) decides again
    deadline = time.monotonic() + 10
    while (resp := complete(gw.base_url, key)).status_code != 200:
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.2)
