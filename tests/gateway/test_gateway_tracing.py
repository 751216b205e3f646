"""Gateway spans through the real app (in process, with a real Redis and a tiny worker process): a request
span parented on the client's `traceparent` when the operator trusts it, else in a trace of its own with a
link to the client's span; authenticate, admission and route children; the tenant only when configured; never
the key or prompt text."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from config.cmd_gateway import build_app
from config.local_stack.launcher import WorkerProc
from config.settings import load_settings
from tenancy import tenant_with_new_key

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
PROMPT = "tell me a secret about zebras"


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProc]:
    proc = WorkerProc(Path(tempfile.mkdtemp(prefix="sy-trace-")))
    try:
        yield proc
    finally:
        proc.stop()


def client(redis_url: str, worker: WorkerProc, **gateway: object) -> TestClient:
    settings = load_settings(overrides={"redis_url": redis_url, "gateway": {
        "workers": [worker.endpoint], "worker_timeout": 20, **gateway}})
    return TestClient(build_app(settings))


def complete(http: TestClient, key: str, **headers: str):
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body,
                     headers={"authorization": f"Bearer {key}", **headers}) as resp:
        assert resp.status_code == 200, resp.read()
        return "".join(resp.iter_text())


def wait_ready(http: TestClient) -> None:
    for _ in range(600):
        if http.get("/ready").status_code == 200:
            return
        time.sleep(0.1)
    raise TimeoutError("gateway not ready")


def test_request_span_tree_follows_the_clients_traceparent(redis_url, worker, spans) -> None:
    key = tenant_with_new_key(redis_url, "traced")
    with client(redis_url, worker, trace_tenant=True, trust_client_trace=True) as http:
        wait_ready(http)
        assert "[DONE]" in complete(http, key, traceparent=CLIENT_PARENT)
    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.name == "POST /v1/completions"]
    assert (f"{root.context.trace_id:032x}" == CLIENT_TRACE
            and f"{root.parent.span_id:016x}" == "b7ad6b7169203331")
    assert (root.attributes["switchyard.tenant"] == "traced"
            and root.attributes["http.response.status_code"] == 200)
    assert root.attributes["switchyard.completion_tokens"] == 3
    children = {s.name: s for s in finished if s.parent is not None
                and s.parent.span_id == root.context.span_id}
    assert {"authenticate", "admission", "route"} <= set(children)
    assert children["route"].attributes["switchyard.worker"]
    assert root.end_time >= children["route"].end_time  # the request span lasts the whole stream
    for span in finished:  # neither the key nor the prompt is anywhere in a span
        text = repr(dict(span.attributes or {})) + span.name
        assert key not in text and "zebras" not in text


def test_an_untrusted_traceparent_is_a_link_and_cannot_turn_sampling_off(redis_url, worker, spans) -> None:
    key = tenant_with_new_key(redis_url, "linked")
    unsampled = f"00-{CLIENT_TRACE}-b7ad6b7169203331-00"  # flags 00: "do not record", as a client might ask
    with client(redis_url, worker) as http:
        wait_ready(http)
        complete(http, key, traceparent=unsampled)
    (root,) = [s for s in spans.get_finished_spans() if s.name == "POST /v1/completions"]
    assert root.parent is None and f"{root.context.trace_id:032x}" != CLIENT_TRACE
    (link,) = root.links
    assert (f"{link.context.trace_id:032x}" == CLIENT_TRACE
            and f"{link.context.span_id:016x}" == "b7ad6b7169203331")


def test_refused_request_span_has_its_status_and_no_tenant_without_the_setting(
        redis_url, worker, spans) -> None:
    key = tenant_with_new_key(redis_url, "quiet")
    with client(redis_url, worker) as http:
        wait_ready(http)
        complete(http, key)
        bad = http.post("/v1/completions", json={"model": "default", "prompt": "x", "temperature": "hot"},
                        headers={"authorization": f"Bearer {key}"})
        assert bad.status_code == 400
    roots = [s for s in spans.get_finished_spans() if s.name == "POST /v1/completions"]
    assert [s.attributes["http.response.status_code"] for s in roots] == [200, 400]
    assert all("switchyard.tenant" not in s.attributes for s in roots)
    assert ("switchyard.error_code" in roots[1].attributes
            and "switchyard.completion_tokens" not in roots[1].attributes)
