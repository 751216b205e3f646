"""TTFT targets through HTTP against a real gateway process, a tiny-model worker with a 768-token KV cache
and a private Redis: the `x-switchyard-ttft-slo-ms` header is checked (400 naming it) and only tightens the
tenant's or the class's target; a saturated pool refuses a request whose target it cannot meet at once, with
503 `ttft_slo_unattainable` and `retry-after`, charging nothing; a feasible one is served; the outcomes are
counted per class and tenant."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.flow.deadlines import TTFT_HEADER
from tenancy.redis_client import sync_client
from tenancy.schema import leases_key
from tests.admission_stack import AdmissionStack, bucket_level, set_bucket

pytestmark = pytest.mark.timeout(180)
PROMPT = list(range(100, 120))  # 20 tokens
KV_BYTES = 400_000  # tiny-random: 768 tokens of KV
CLASS_DEFAULT_MS = 1500


@pytest.fixture(scope="module")
def stack() -> Iterator[AdmissionStack]:
    s = AdmissionStack.start(gateway_settings={
        "admission_wait_ms": 3000, "metrics_tenant_labels": ["tight", "easy"],
        "ttft_slo_ms": {"interactive": CLASS_DEFAULT_MS, "batch": 0}},
        worker_args=["--kv-cache-bytes", str(KV_BYTES)])
    try:
        s.warm_up(4)
        yield s
    finally:
        s.stop()


@pytest.fixture()
def r(stack):
    client = sync_client(stack.redis.url)
    yield client
    client.close()


def body(max_tokens: int = 60) -> dict:
    return {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}


def headers(key: str, ttft: str | None = None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **({TTFT_HEADER: ttft} if ttft is not None else {})}


def slo_count(url: str, outcome: str, tenant: str) -> float:
    text = httpx.get(url + "/metrics").text
    pattern = re.compile(r'^switchyard_ttft_slo_total\{([^}]*)\} (\S+)$', re.M)
    return sum(float(v) for labels, v in pattern.findall(text)
               if f'outcome="{outcome}"' in labels and f'tenant="{tenant}"' in labels
               and 'priority="interactive"' in labels)


def test_an_invalid_header_is_a_400_naming_it(stack):
    key = stack.create_tenant("header", tpm=0, rpm=0, max_concurrent=0)
    url = stack.gateways[0].base_url
    for bad in ("soon", "0", "-5", "1.5", "99999999"):
        resp = httpx.post(url + "/v1/completions", json=body(), headers=headers(key, bad), timeout=30)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == TTFT_HEADER and TTFT_HEADER in err["message"], err


def test_a_feasible_target_is_served_and_counted_met(stack):
    key = stack.create_tenant("easy", ttft_slo_ms=60_000, tpm=0, rpm=0, max_concurrent=0)
    url = stack.gateways[0].base_url
    target, met = slo_count(url, "target", "easy"), slo_count(url, "met", "easy")
    resp = httpx.post(url + "/v1/completions", json=body(4), headers=headers(key, "30000"), timeout=60)
    assert resp.status_code == 200, resp.text
    assert slo_count(url, "target", "easy") == target + 1
    assert slo_count(url, "met", "easy") == met + 1


async def test_a_saturated_pool_sheds_an_unattainable_target_at_once_and_charges_nothing(stack, r):
    url = stack.gateways[0].base_url
    filler = stack.create_tenant("filler", tpm=0, rpm=0, max_concurrent=0)
    tight = stack.create_tenant("tight", ttft_slo_ms=2000, tpm=100_000, rpm=0, max_concurrent=0)
    plain = stack.create_tenant("plain", tpm=0, rpm=0, max_concurrent=0)  # the class default applies
    shed_before = slo_count(url, "shed", "tight")
    time.sleep(1.5)  # an idle gap: the filler starts a new busy period, with no drain measured yet
    async with httpx.AsyncClient(timeout=120) as http:
        # 20 + 700 of the 768 KV tokens: no request of 80 fits until it ends
        fill = asyncio.ensure_future(http.post(url + "/v1/completions", json=body(700),
                                               headers=headers(filler)))
        await asyncio.sleep(0.5)
        set_bucket(r, "tight", 50_000, 0)
        level0, t0 = bucket_level(r, "tight", 100_000)
        messages = {}
        for name, key, ttft in (("tightened", tight, "50"), ("bounded", tight, "99999"),
                                ("class", plain, None)):
            start = time.monotonic()
            resp = await http.post(url + "/v1/completions", json=body(), headers=headers(key, ttft))
            elapsed = time.monotonic() - start
            assert resp.status_code == 503, (name, resp.text)
            err = resp.json()["error"]
            assert err["code"] == "ttft_slo_unattainable" and err["param"] is None, err
            assert 1 <= int(resp.headers["retry-after"]) <= 30 and int(resp.headers["retry-after-ms"]) >= 1000
            assert elapsed < 1.5, (name, elapsed)  # at once, not after admission_wait_ms (3 s)
            messages[name] = err["message"]
        level1, t1 = bucket_level(r, "tight", 100_000)
        assert not fill.done()  # the pool stayed saturated throughout
        filled = await fill
    assert filled.status_code == 200, filled.text
    assert "target of 50 ms" in messages["tightened"]  # the header tightens the tenant's 2000 ms
    assert "target of 2000 ms" in messages["bounded"]  # a looser header is bounded by it
    assert f"target of {CLASS_DEFAULT_MS} ms" in messages["class"]  # no tenant target: the class default
    refill = (t1 - t0) * 100_000 / 60e6
    assert level1 == pytest.approx(level0 + refill, abs=1.0)  # the reservations were refunded in full
    assert r.zcard(leases_key("tight")) == 0
    assert slo_count(url, "shed", "tight") == shed_before + 2
