"""A batch submitted through the `openai` SDK to one of two gateways completes when that gateway is SIGKILLed
midway: the other gateway takes over the lines the dead one had claimed, and every line is answered exactly
once (real gateways, worker, Redis and a shared files directory)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator

import openai
import pytest

from tests.admission_stack import AdmissionStack

# two gateway processes, a worker and a batch: a long multi-process scenario, `make test-heavy`
pytestmark = [pytest.mark.timeout(240), pytest.mark.heavy]
LINES = 48


@pytest.fixture()
def stack(tmp_path) -> Iterator[AdmissionStack]:
    files = tmp_path / "files"
    files.mkdir()
    s = AdmissionStack.start(gateways=2, gateway_settings={"files_dir": str(files), "batch_concurrency": 2,
                                                           "batch_claim_idle_s": 2.0})
    try:
        yield s
    finally:
        s.stop()


def _wait(client: openai.OpenAI, batch_id: str, done, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status}: {batch.request_counts}")


def test_a_batch_completes_once_when_the_gateway_it_was_sent_to_is_sigkilled(stack):
    key = stack.create_tenant("offline", tpm=0, rpm=0, max_concurrent=0)
    first, second = (openai.OpenAI(api_key=key, base_url=g.base_url + "/v1", max_retries=0, timeout=30)
                     for g in stack.gateways)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "default", "prompt": f"count {i}", "max_tokens": 24, "ignore_eos": True,
                       "temperature": 0}} for i in range(LINES)]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    fid = first.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = first.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h")
    midway = _wait(second, batch.id, lambda b: b.request_counts.completed >= 6, 120)
    stack.gateways[0].kill()                                  # SIGKILL: its claimed lines are in flight
    assert midway.request_counts.completed < LINES - 4        # lines were left for the survivor
    done = _wait(second, batch.id, lambda b: b.status in ("completed", "failed", "expired"), 150)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == \
        (LINES, LINES, 0)
    out = [json.loads(x) for x in second.files.content(done.output_file_id).content.splitlines()]
    ids = [x["custom_id"] for x in out]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines) and len(set(ids)) == LINES  # once each
    assert all(x["response"]["status_code"] == 200 for x in out)
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 24 for x in out)
    assert done.error_file_id is None
