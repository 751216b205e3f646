"""Structured logs: the JSON formatter, the request-id context, and a real gateway's and worker's log files.

The end-to-end part runs on the shared stack (`tests.gateway_stack`, JSON logs
by default): requests sent with a chosen `x-request-id` must be echoed in the
header (streams included) and appear as that `request_id` on the gateway's
access lines, every line of both log files must be one JSON object, and
neither the API key nor the prompt text may appear anywhere in them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import uuid

import httpx
import pytest

from config.logs import JsonFormatter
from gateway.telemetry.request_log import RequestIdFilter, bind_request_id
from tests.gateway_stack import GatewayStack

pytestmark = pytest.mark.timeout(300)


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("switchyard.test", logging.WARNING, __file__, 1, msg, args, None)
    for k, v in extra.items():
        setattr(record, k, v)
    return record


def test_json_formatter_fields_extra_and_exception() -> None:
    fmt = JsonFormatter()
    line = json.loads(fmt.format(_record("served %d tokens", 7, status=200, request_id="req-abc")))
    assert line["level"] == "WARNING" and line["logger"] == "switchyard.test"
    assert line["msg"] == "served 7 tokens" and line["status"] == 200 and line["request_id"] == "req-abc"
    assert line["ts"].endswith("+00:00") and "T" in line["ts"]
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    out = json.loads(fmt.format(rec))
    assert "ValueError: boom" in out["exc"] and "request_id" not in out
    odd = json.loads(fmt.format(_record("x", when=object())))  # not JSON-serializable: written with str()
    assert odd["when"].startswith("<object object")


def test_request_id_filter_uses_the_context_unless_given() -> None:
    flt = RequestIdFilter()

    def in_request() -> tuple[object, object]:
        bind_request_id("req-ctx")
        a, b = _record("a"), _record("b", request_id="req-explicit")
        flt.filter(a)
        flt.filter(b)
        return a.request_id, b.request_id

    assert contextvars.copy_context().run(in_request) == ("req-ctx", "req-explicit")
    outside = _record("c")
    flt.filter(outside)
    assert getattr(outside, "request_id", None) is None  # the context above did not leak out


def _json_lines(path) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert lines, f"{path} is empty"
    return [json.loads(line) for line in lines]  # raises on any non-JSON line


def test_gateway_and_worker_logs_are_json_with_request_ids_and_no_secrets(stack: GatewayStack) -> None:
    marker = "zebra" + uuid.uuid4().hex[:8]  # prompt text that must never be logged
    ids = {name: f"obs-{name}-{uuid.uuid4().hex[:8]}" for name in ("stream", "plain", "bad")}
    headers = {"authorization": f"Bearer {stack.key}"}
    chat = {"model": "default", "messages": [{"role": "user", "content": f"Say {marker}"}], "max_tokens": 2}
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True},
                           headers={**headers, "x-request-id": ids["stream"]}) as resp:
            assert resp.status_code == 200
            assert resp.headers["x-request-id"] == ids["stream"]
            assert resp.read().rstrip().endswith(b"data: [DONE]")
        plain = client.post("/v1/chat/completions", json=chat,
                            headers={**headers, "x-request-id": ids["plain"]})
        assert plain.status_code == 200 and plain.headers["x-request-id"] == ids["plain"]
        bad = client.post("/v1/chat/completions", json={**chat, "max_tokens": -1},
                          headers={**headers, "x-request-id": ids["bad"]})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == ids["bad"]
        invalid = client.get("/v1/models", headers={**headers, "x-request-id": "bad id with spaces"})
        assert invalid.headers["x-request-id"].startswith("req-")  # a malformed client id is replaced

    log_dir = stack.stack.config.log_dir
    assert log_dir is not None
    deadline = time.monotonic() + 10
    while True:  # the access line is written right after the response; allow for buffering
        gateway = _json_lines(log_dir / "gateway.log")
        seen = {line.get("request_id") for line in gateway}
        if set(ids.values()) <= seen or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert set(ids.values()) <= seen
    by_id = {line["request_id"]: line for line in gateway
             if line.get("logger") == "switchyard.gateway.access"}
    assert by_id[ids["stream"]]["status"] == 200 and by_id[ids["bad"]]["status"] == 400
    for line in gateway:
        assert {"ts", "level", "logger", "msg"} <= line.keys()
    worker = _json_lines(log_dir / "worker.log")
    assert any(line["logger"].startswith("worker") for line in worker)
    for name in ("gateway.log", "worker.log"):
        text = (log_dir / name).read_text()
        # neither the key nor its secret tail (keys may hold "_")
        assert stack.key not in text and stack.key[-12:] not in text, name
        assert marker not in text, name
