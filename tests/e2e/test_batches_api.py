"""`/v1/batches` through the official `openai` SDK against the shared real stack: a small batch completes with
one output line per request; lines are validated before it starts; cancel; another tenant's batch is a 404."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=stack.key, base_url=stack.base_url + "/v1", max_retries=0, timeout=60)


def _upload(client: openai.OpenAI, n: int, url: str = "/v1/chat/completions", **body) -> str:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": url,
              "body": {"model": "default", "messages": [{"role": "user", "content": f"say {i}"}],
                       "max_tokens": 3, **body}} for i in range(n)]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    return client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch").id


def _wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...]):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch still {b.status}")


def test_batch_completes_with_each_line_once(client, stack):
    fid = _upload(client, 3)
    b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "t"})
    assert b.status == "in_progress" and b.request_counts.total == 3 and b.metadata == {"job": "t"}
    done = _wait(client, b.id, ("completed", "failed"))
    assert done.status == "completed"
    assert done.request_counts.completed == 3 and done.request_counts.failed == 0
    lines = [json.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["r0", "r1", "r2"]
    for x in lines:
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert x["response"]["body"]["object"] == "chat.completion"
        assert x["response"]["body"]["usage"]["completion_tokens"] <= 3
    assert done.output_file_id in [f.id for f in client.files.list(purpose="batch_output")]
    assert b.id in [x.id for x in client.batches.list(limit=5)]
    other = openai.OpenAI(api_key=stack.batch_key, base_url=stack.base_url + "/v1", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(b.id)
    assert b.id not in [x.id for x in other.batches.list()]


def test_invalid_lines_fail_the_batch_before_it_starts(client):
    fid = _upload(client, 2, max_tokens=10**9)
    b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and [e.line for e in b.errors.data] == [1, 2]
    assert all(e.param == "max_tokens" for e in b.errors.data)
    fid = _upload(client, 1, stream=True)
    b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and b.errors.data[0].param == "stream"
    fid = _upload(client, 1)
    b = client.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h")
    assert b.status == "failed" and b.errors.data[0].param == "url"


def test_create_argument_errors(client):
    fid = _upload(client, 1)
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=fid, endpoint="/v1/embeddings", completion_window="24h")
    assert err.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="1h")
    assert err.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-0000000000000000000000000", endpoint="/v1/completions",
                              completion_window="24h")


def test_cancel(client):
    fid = _upload(client, 5, max_tokens=48)
    b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    done = _wait(client, b.id, ("cancelled",))
    assert done.cancelled_at is not None and done.cancelling_at is not None and done.completed_at is None
    out = done.output_file_id
    answered = 0 if out is None else len(client.files.content(out).content.splitlines())
    assert done.request_counts.total == 5 and done.request_counts.completed == answered
    assert client.batches.cancel(b.id).status == "cancelled"  # a second cancel answers as the first
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(_wait(client, client.batches.create(
            input_file_id=_upload(client, 1), endpoint="/v1/chat/completions", completion_window="24h").id,
            ("completed",)).id)
