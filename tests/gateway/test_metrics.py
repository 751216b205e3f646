"""Prometheus `/metrics` of a real gateway and a real worker after a known set of requests.

A private stack (redis-server, a `tiny-random` worker serving `--metrics-port`,
a gateway with the default tokenizer and `--metrics-tenant-labels acme`) gets
streamed and non-streamed requests from two tenants plus a 401, a 400 and a
429; the gateway's counters must move by exactly those requests and the usage
the responses reported, and the worker's gauges must return to idle.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from config.local_stack.launcher import Stack, StackConfig, free_port
from tests.deploy.test_grafana_dashboard import CONTRACT

pytestmark = pytest.mark.timeout(180)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample by (name, labels); a declared family is also listed as ("# TYPE", name) -> 1."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["content-type"].startswith("text/plain")
        text = resp.read().decode()
    out: Samples = {("# TYPE", line.split()[2]): 1.0 for line in text.splitlines()
                    if line.startswith("# TYPE ")}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def post(base: str, key: str, body: dict) -> tuple[int, dict | str, dict]:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"authorization": f"Bearer {key}",
                                          "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read().decode()
            return resp.status, raw if body.get("stream") else json.loads(raw), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def stream_usage(raw: str) -> dict:
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Stack, int]]:
    logs = Path(tempfile.mkdtemp(prefix="sy-metrics-test-"))
    worker_port = free_port()
    s = Stack(StackConfig(port=free_port(), log_dir=logs, ready_timeout=120.0,
                          worker_args=["--model", "tiny-random", "--no-prefix-cache", "--num-threads", "1",
                                       "--kv-cache-bytes", str(16 << 20), "--metrics-port", str(worker_port)],
                          gateway_args=["--metrics-tenant-labels", "acme"]))
    s.start()
    try:
        yield s, worker_port
    finally:
        s.stop()


def chat(content: str, **kw: object) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "ignore_eos": True, **kw}


def test_gateway_metrics_count_the_requests_made(stack: tuple[Stack, int]) -> None:
    s, _ = stack
    acme, beta, limited = s.create_tenant("acme"), s.create_tenant("beta"), s.create_tenant("onerpm", rpm=1)
    url = s.base_url + "/metrics"
    before = scrape(url)

    usage = {"acme": [0, 0, 0], "other": [0, 0, 0]}
    streamed = 0
    for i, (tenant, key, stream) in enumerate([("acme", acme, True), ("acme", acme, True),
                                               ("acme", acme, False), ("other", beta, True),
                                               ("other", beta, False)]):
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        status, body, _ = post(s.base_url, key, chat(f"count to {i}", **extra))
        assert status == 200, body
        u = stream_usage(body) if stream else body["usage"]
        usage[tenant][0] += u["prompt_tokens"]
        usage[tenant][1] += u["completion_tokens"]
        usage[tenant][2] += u["prompt_tokens_details"]["cached_tokens"]
        streamed += stream
    assert post(s.base_url, "sk-not-a-key", chat("x"))[0] == 401
    assert post(s.base_url, acme, {"model": "default", "messages": "nope"})[0] == 400
    assert post(s.base_url, limited, chat("first"))[0] == 200  # also counted under "other"
    status, body, headers = post(s.base_url, limited, chat("second"))
    assert status == 429 and "retry-after" in {k.lower() for k in headers}
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    present = {labels for n, labels in after if n == "# TYPE"}
    gateway_names = {n for n in CONTRACT if not n.startswith("switchyard_worker_")}
    assert gateway_names <= present, gateway_names - present
    assert delta("switchyard_requests_total", status="200") == 6
    assert delta("switchyard_requests_total", status="401") == 1
    assert delta("switchyard_requests_total", status="400") == 1
    assert delta("switchyard_requests_total", status="429") == 1
    assert delta("switchyard_rate_limited_total", reason="requests", tenant="other") == 1
    assert sum(delta("switchyard_shed_total", reason=r)
               for r in ("capacity", "no_worker", "draining", "quota_service_unavailable")) == 0
    # usage of the rpm=1 tenant's one served request goes to "other" too: read it from the counters' growth
    other_extra = delta("switchyard_prompt_tokens_total", tenant="other") - usage["other"][0]
    assert other_extra > 0
    for i, name in enumerate(("switchyard_prompt_tokens_total", "switchyard_completion_tokens_total",
                              "switchyard_cached_tokens_total")):
        assert delta(name, tenant="acme") == usage["acme"][i], name
    assert delta("switchyard_completion_tokens_total", tenant="other") == usage["other"][1] + 6
    assert delta("switchyard_ttft_seconds_count", priority="interactive", tenant="acme") == 2
    assert delta("switchyard_ttft_seconds_count", priority="interactive", tenant="other") == streamed - 2
    assert delta("switchyard_e2e_seconds_count", priority="interactive", tenant="acme") == 3
    assert delta("switchyard_e2e_seconds_count", priority="interactive", tenant="other") == 3
    assert delta("switchyard_queue_seconds_count", priority="interactive", tenant="acme") == 3
    # 6 tokens per stream: 5 gaps after the first, at most one observation each
    itl = delta("switchyard_inter_token_seconds_count", priority="interactive", tenant="acme")
    assert 1 <= itl <= 10
    assert delta("switchyard_ttft_seconds_sum", priority="interactive", tenant="acme") > 0
    assert (total(after, "switchyard_router_requests_total")
            - total(before, "switchyard_router_requests_total") == 6)


def settled_scrape(url: str, timeout: float = 10.0):
    """A worker scrape once earlier tests' requests have all reached its counters (two scrapes, a few
    stats ticks apart, agree and nothing runs), so deltas count only this test's requests."""
    deadline = time.monotonic() + timeout
    last = scrape(url)
    while time.monotonic() < deadline:
        time.sleep(0.35)
        now = scrape(url)
        stable = all(value(now, n) == value(last, n) for n in (
            "switchyard_worker_prompt_tokens_total", "switchyard_worker_generated_tokens_total"))
        if stable and value(now, "switchyard_worker_running_requests") == 0:
            return now
        last = now
    raise AssertionError("worker counters never settled")


def test_worker_metrics_plausible_and_back_to_idle(stack: tuple[Stack, int]) -> None:
    s, port = stack
    key = s.create_tenant("acme")
    url = f"http://127.0.0.1:{port}/metrics"
    before = settled_scrape(url)
    made = []
    for i in range(3):
        status, body, _ = post(s.base_url, key, chat(f"worker {i}", max_tokens=5))
        assert status == 200, body
        made.append(body["usage"])
    deadline = time.monotonic() + 10
    while True:  # gauges follow the worker's stats tick (100 ms)
        after = scrape(url)
        grown = value(after, "switchyard_worker_generated_tokens_total") - value(
            before, "switchyard_worker_generated_tokens_total")
        idle = value(after, "switchyard_worker_kv_pages_used") == 0
        if (grown >= 15 and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    worker_names = {n for n in CONTRACT if n.startswith("switchyard_worker_")}
    present = {labels for n, labels in after if n == "# TYPE"}
    assert worker_names <= present, worker_names - present
    assert value(after, "switchyard_worker_kv_pages_total") > 0
    assert value(after, "switchyard_worker_kv_pages_used") == 0
    assert value(after, "switchyard_worker_running_requests") == 0
    assert value(after, "switchyard_worker_waiting_requests") == 0

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("switchyard_worker_prompt_tokens_total") == sum(u["prompt_tokens"] for u in made)
    assert (delta("switchyard_worker_generated_tokens_total") == sum(u["completion_tokens"] for u in made)
            == 15)
    assert delta("switchyard_worker_prefill_seconds_count") == 3
    assert delta("switchyard_worker_queue_seconds_count") == 3
    assert delta("switchyard_worker_step_seconds_count") >= 5  # at least one step per token of a request
    assert delta("switchyard_worker_preemptions_total") == 0
    assert 0 <= value(after, "switchyard_worker_prefix_hit_rate") <= 1
    assert value(after, "switchyard_worker_batch_size") == 0  # idle


@pytest.mark.parametrize("labelled", [(), ("acme",)])
def test_request_trace_records_with_and_without_tenant_labels(labelled: tuple[str, ...]) -> None:
    from prometheus_client import CollectorRegistry

    from gateway.telemetry.gateway_metrics import GatewayMetrics

    reg = CollectorRegistry()
    m = GatewayMetrics(labelled, registry=reg)
    for tenant in ("acme", "zed"):
        trace = m.trace("batch", tenant, time.perf_counter())
        trace.admitted()
        trace.first_token(1)
        trace.next_chunk(3)
        trace.next_chunk(3)  # no new tokens: no observation
        trace.finished(10, 3, 4, completed=True)
    m.trace("interactive", "zed", time.perf_counter()).finished(10, 0, 0, completed=False)  # never served
    tenant = {"tenant": "acme"} if labelled else {}
    other = {"tenant": "other"} if labelled else {}
    get = reg.get_sample_value
    if labelled:
        assert (get("switchyard_prompt_tokens_total", tenant) == 10
                == get("switchyard_prompt_tokens_total", other))
        assert get("switchyard_ttft_seconds_count", {"priority": "batch", **other}) == 1
    else:
        assert get("switchyard_prompt_tokens_total", {}) == 20
        assert get("switchyard_cached_tokens_total", {}) == 8
        assert get("switchyard_inter_token_seconds_count", {"priority": "batch"}) == 2
    assert get("switchyard_e2e_seconds_count", {"priority": "batch", **tenant}) == (1 if labelled else 2)
    assert get("switchyard_e2e_seconds_count", {"priority": "interactive", **other}) is None
    assert get("switchyard_shed_total", {"reason": "draining"}) == 0


def test_multiprocess_mode_sums_every_process(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR (uvicorn --workers N) /metrics aggregates all processes' values."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    bump = ("import time; from gateway.telemetry.gateway_metrics import current; m = current(); "
            "m.count_shed('capacity'); t = m.trace('interactive', 'acme', time.perf_counter()); "
            "t.finished(5, 2, 0, completed=True)")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", bump], env=env, check=True, timeout=60)
    show = ("import sys; from gateway.telemetry.gateway_metrics import exposition; "
            "sys.stdout.write(exposition()[0].decode())")
    text = subprocess.run([sys.executable, "-c", show], env=env, check=True, timeout=60, capture_output=True,
                          text=True).stdout
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("switchyard_shed_total", (("reason", "capacity"),))] == 2
    assert samples[("switchyard_prompt_tokens_total", ())] == 10
    assert samples[("switchyard_e2e_seconds_count", (("priority", "interactive"),))] == 2
