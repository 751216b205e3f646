"""Fixtures and helpers of the hostile-input, schemathesis and tenant-isolation fault tests.

`fault_stack` is one real stack for the session (private redis-server, a
`tiny-random` worker WITH the prefix cache and a metrics port, a gateway logging
at DEBUG with a 2 s body timeout), started through `tests.gateway_stack`.
`cluster` is the 3-worker fault cluster of the load/fault cases (`tests.faults.cluster`),
shared by their modules and stopped at the end of the session.
`expect_error` asserts an OpenAI error body field by field (a None `param` or
`code` must be None), and `assert_served_cleanly` is the after-the-storm check:
gateway process alive, no 5xx other than 503 in its `/metrics`, no internal
error in its log, and a normal request still answered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port
from tests.faults.cluster import FaultCluster, shared_cluster, stop_shared_cluster
from tests.gateway_stack import GatewayStack, start_gateway_stack

BODY_TIMEOUT_S = 2.0
NORMAL = {"model": "default", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
_STATUS_LINE = re.compile(r'^switchyard_requests_total\{status="(\d+)"\} ([0-9.e+]+)$', re.M)


@pytest.fixture(scope="session")
def worker_metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def fault_stack(worker_metrics_port: int) -> Iterator[GatewayStack]:
    s = start_gateway_stack(
        worker_model="tiny-random", prefix_cache=True,
        worker_args=["--num-threads", "1", "--metrics-port", str(worker_metrics_port),
                     "--drain-timeout", "2"],
        gateway_args=["--body-timeout", str(BODY_TIMEOUT_S), "--worker-timeout", "20", "--log-level", "DEBUG",
                      "--drain-timeout", "2"])
    try:
        yield s
    finally:
        s.stack.stop()


@pytest.fixture(scope="session")
def _shared_fault_cluster() -> Iterator[None]:
    yield
    stop_shared_cluster()


@pytest.fixture()
def cluster(_shared_fault_cluster: None) -> FaultCluster:
    return shared_cluster()


def post(stack: GatewayStack, path: str, content: bytes, key: str | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60.0) -> httpx.Response:
    hdrs = {"authorization": f"Bearer {key or stack.key}", "content-type": "application/json",
            **(headers or {})}
    return httpx.post(stack.base_url + path, content=content, headers=hdrs, timeout=timeout)


def expect_error(resp: httpx.Response, status: int, code: str | None, param: str | None,
                 type_: str = "invalid_request_error") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"], err["param"]) == (type_, code, param), err
    assert isinstance(err["message"], str) and err["message"]
    return err


def status_counts(stack: GatewayStack) -> dict[int, float]:
    """The gateway's `/v1/` responses so far, by HTTP status (from its /metrics)."""
    text = httpx.get(stack.base_url + "/metrics", timeout=10).text
    return {int(code): float(n) for code, n in _STATUS_LINE.findall(text)}


def gateway_log(stack: GatewayStack) -> str:
    assert stack.stack.config.log_dir is not None
    return (stack.stack.config.log_dir / "gateway.log").read_text(errors="replace")


def assert_served_cleanly(stack: GatewayStack) -> None:
    assert stack.stack.procs["gateway"].poll() is None, "the gateway process died"
    server_errors = {s: n for s, n in status_counts(stack).items() if s >= 500 and s != 503}
    assert not server_errors, f"5xx answers: {server_errors}"
    log = gateway_log(stack)
    assert "internal error" not in log and "Traceback" not in log, log[-4000:]
    resp = post(stack, "/v1/completions", json.dumps(NORMAL).encode())
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["usage"]["prompt_tokens"] > 0
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
