"""`/v1/files` through the official `openai` SDK against the shared real stack: upload a batch file, list,
retrieve, download its content, delete; every line checked at upload (400 naming `file` and the line); other
purposes and unknown fields refused; another tenant's file is a 404."""

from __future__ import annotations

import io
import json

import openai
import pytest


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=stack.key, base_url=stack.base_url + "/v1", max_retries=0, timeout=60)


def _line(cid: str, url: str = "/v1/chat/completions", **extra) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            **extra}


def _jsonl(*lines: dict) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def test_upload_list_retrieve_content_delete(client, stack):
    data = _jsonl(_line("a"), _line("b", "/v1/responses"))
    up = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    assert up.id.startswith("file-") and up.bytes == len(data) and up.purpose == "batch"
    assert up.filename == "requests.jsonl" and up.status == "processed"
    assert client.files.retrieve(up.id).bytes == len(data)
    assert client.files.content(up.id).content == data
    assert up.id in [f.id for f in client.files.list(purpose="batch")]
    other = openai.OpenAI(api_key=stack.batch_key, base_url=stack.base_url + "/v1", max_retries=0, timeout=60)
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(up.id)  # another tenant's file: not found, never forbidden
    assert up.id not in [f.id for f in other.files.list()]
    assert client.files.delete(up.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(up.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(up.id)


def test_list_orders_and_pages(client):
    ids = [client.files.create(file=(f"f{i}.jsonl", io.BytesIO(_jsonl(_line("x")))), purpose="batch").id
           for i in range(3)]
    try:
        page = client.files.list(limit=2, order="asc", extra_query={})
        listed = [f.id for f in client.files.list(order="asc").data]
        assert [i for i in listed if i in ids] == ids
        assert len(page.data) == 2 and page.has_more is True
    finally:
        for i in ids:
            client.files.delete(i)


@pytest.mark.parametrize(("lines", "needle"), [
    (b"not json\n", "Line 1 is not valid JSON"),
    (_jsonl(_line("a"), _line("a")), "Line 2: custom_id 'a' is used twice"),
    (_jsonl(_line("a", "/v1/embeddings")), "Line 1: 'url' must be one of"),
    (_jsonl({**_line("a"), "method": "GET"}), "Line 1: 'method' must be POST"),
    (_jsonl(_line("a", extra_field=1)), "Line 1: unrecognized field 'extra_field'"),
    (b"\n", "holds no requests"),
])
def test_each_line_is_checked_at_upload(client, lines, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("bad.jsonl", io.BytesIO(lines)), purpose="batch")
    assert err.value.body["param"] == "file" and needle in err.value.body["message"]


def test_other_purposes_and_unknown_fields_are_400s(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("a.jsonl", io.BytesIO(_jsonl(_line("a")))), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("a.jsonl", io.BytesIO(_jsonl(_line("a")))), purpose="batch",
                            extra_body={"expires_after[anchor]": "created_at"})
    assert err.value.body["param"] == "expires_after[anchor]"
    with pytest.raises(openai.BadRequestError) as err:
        client.files.list(extra_query={"cursor": "x"})
    assert err.value.body["param"] == "cursor"
