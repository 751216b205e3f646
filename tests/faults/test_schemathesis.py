"""The OpenAPI description against the parser, then schemathesis against a live gateway.

First, without any process: every numeric bound, enum and array limit that
`gateway/openai/openapi.py` documents is exactly where `gateway.openai.schemas` starts
answering 400 with that field as `param`. Then the fault suite's gateway serves
the same document at `/openapi.json`, and schemathesis (its CLI, in a
subprocess with a deadline) fuzzes every operation from it with a valid API key:
valid and invalid bodies, about 80 cases with a fixed seed
(`SWITCHYARD_FUZZ_SEED` picks another), checking for no 5xx, documented status
codes and content types, responses that match their schemas, schema-violating
bodies rejected, and undocumented methods answered 405.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any
from xml.etree import ElementTree

import httpx
import pytest

from gateway.openai.openapi import build_document
from gateway.openai.schemas import parse_chat, parse_completion
from gateway.web.api_errors import ApiError
from tests import REPO
from tests.faults.conftest import assert_served_cleanly

# generous: the first test also pays for starting the session stack (bounded by its 240 s ready timeout)
pytestmark = pytest.mark.timeout(330)

DOC = build_document()
SCHEMAS = DOC["components"]["schemas"]
BASE = {"ChatCompletionRequest": {"model": "default", "messages": [{"role": "user", "content": "hi"}]},
        "CompletionRequest": {"model": "default", "prompt": "hi"}}
PARSERS = {"ChatCompletionRequest": parse_chat, "CompletionRequest": parse_completion}
FUZZ_SEED = int(os.environ.get("SWITCHYARD_FUZZ_SEED", "20240901"))
MAX_EXAMPLES = 30  # per operation; the GET operations have only a handful of distinct cases
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "negative_data_rejection,unsupported_method")


def rejected_param(request: str, field: str, value: Any) -> str | None:
    """The `param` of the parser's 400 for `field=value`, or None when it accepts the body."""
    try:
        PARSERS[request]({**BASE[request], field: value})
    except ApiError as exc:
        assert exc.status == 400
        return exc.param or "<none>"
    return None


def bounded_fields() -> list[tuple[str, str, dict]]:
    return [(req, name, spec) for req in PARSERS for name, spec in SCHEMAS[req]["properties"].items()
            if "maximum" in spec or "enum" in spec]


@pytest.mark.parametrize(("request_schema", "field", "spec"), bounded_fields(),
                         ids=[f"{r[:4]}-{f}" for r, f, _ in bounded_fields()])
def test_documented_bounds_are_the_parsers(request_schema, field, spec):
    assert "null" in spec["type"] and rejected_param(request_schema, field, None) is None  # null: not given
    if "enum" in spec:
        for value in spec["enum"]:
            assert rejected_param(request_schema, field, value) is None
        outside = {"integer": 2, "string": "surely-not-allowed", "boolean": True}[spec["type"][0]]
        assert rejected_param(request_schema, field, outside) == field
        return
    step = 1 if "integer" in spec["type"] else 1e-9
    lo_ok = spec.get("minimum")
    lo = lo_ok if lo_ok is not None else spec["exclusiveMinimum"]
    hi = spec["maximum"]
    for value in (hi, lo_ok) if lo_ok is not None else (hi, lo + step):
        assert rejected_param(request_schema, field, value) is None, (field, value)
    assert rejected_param(request_schema, field, hi + step) == field
    assert rejected_param(request_schema, field, lo - step if lo_ok is not None else lo) == field


def test_documented_array_limits_are_the_parsers():
    stop = SCHEMAS["CompletionRequest"]["properties"]["stop"]["anyOf"][1]
    assert rejected_param("CompletionRequest", "stop", ["x"] * stop["maxItems"]) is None
    assert rejected_param("CompletionRequest", "stop", ["x"] * (stop["maxItems"] + 1)) == "stop"
    assert rejected_param("CompletionRequest", "stop", [""]) == "stop"  # minLength 1
    assert rejected_param("ChatCompletionRequest", "messages", []) == "messages"  # minItems 1
    assert rejected_param("CompletionRequest", "prompt", "") == "prompt"
    for req in PARSERS:
        for name in SCHEMAS[req]["required"]:
            body = {k: v for k, v in BASE[req].items() if k != name}
            with pytest.raises(ApiError) as exc:
                PARSERS[req](body)
            assert exc.value.param == name


def test_openapi_json_is_served(fault_stack):
    resp = httpx.get(fault_stack.base_url + "/openapi.json", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    assert resp.json() == DOC and DOC["openapi"].startswith("3.1")


def test_schemathesis_finds_nothing(fault_stack, tmp_path):
    # Its own tenant: unlimited rate so no 429 noise, and at most 2 tokens so a valid case costs little.
    key = fault_stack.stack.create_tenant("fuzz", tpm=0, rpm=0, max_concurrent=0, max_tokens=2,
                                          default_max_tokens=2)
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", fault_stack.base_url + "/openapi.json",
           "-H", f"Authorization: Bearer {key}", "--checks", CHECKS, "--phases", "examples,fuzzing",
           "--mode", "all", "--max-examples", str(MAX_EXAMPLES), "--seed", str(FUZZ_SEED), "--workers", "1",
           "--request-timeout", "30", "--no-shrink", "--max-failures", "5", "--generation-database", "none",
           "--no-color", "--report", "junit", "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    suite = ElementTree.parse(next(tmp_path.glob("junit*.xml"))).getroot()
    tested = {case.get("name") for case in suite.iter("testcase")}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= tested, tested
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0"), out[-6000:]
    generated = re.search(r"(\d+) generated", out)
    assert generated and int(generated.group(1)) >= 50, out[-3000:]  # about 80 cases ran
    assert key not in out  # schemathesis filters the header; the key must not leak into CI logs either
    assert_served_cleanly(fault_stack)
