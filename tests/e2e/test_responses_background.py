"""Background responses (`background: true`) through the official `openai` SDK against the shared real stack:
the POST answers `queued` at once and `retrieve` polls the run to completion; a cancel stops a long run
(status `cancelled`, the worker request aborted, the tenant's lease gone and its unused tokens refunded);
another tenant's id is a 404 on retrieve and cancel; a cancel of a foreground or finished response, background
without store, background with stream and a streamed GET are 400s naming their field."""

from __future__ import annotations

import os
import time

import openai
import pytest
import redis

from tenancy.schema import leases_key, usage_key
from tests.admission_stack import bucket_level

QUESTION = "What is the capital of France?"
COUNT = "Count from 1 to 5000, separated by commas."
TPM = 4_000  # refills 67 tokens/s: a reservation not refunded shows for half a minute


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=stack.key, base_url=stack.base_url + "/v1", max_retries=0, timeout=120)


def poll(client: openai.OpenAI, rid: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        resp = client.responses.retrieve(rid)
        if resp.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return resp
        time.sleep(0.1)


def test_a_background_run_is_polled_to_completion(client):
    started = client.responses.create(model="default", input=QUESTION, temperature=0, max_output_tokens=20,
                                      background=True)
    assert started.status in ("queued", "in_progress") and started.background is True and started.output == []
    done = poll(client, started.id)
    assert (done.status in ("completed", "incomplete") and "Paris" in done.output_text
            and done.background is True)
    assert 0 < done.usage.output_tokens <= 20
    (item,) = client.responses.input_items.list(done.id).data
    assert item.content[0].text == QUESTION
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(done.id)
    assert f"already {done.status}" in err.value.body["message"]
    follow = client.responses.create(model="default", input="And of Germany?", previous_response_id=done.id,
                                     max_output_tokens=5)
    assert follow.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


def test_cancel_stops_a_long_run_and_refunds_the_reservation(stack):
    name = "bg-" + os.urandom(3).hex()
    sdk = openai.OpenAI(api_key=stack.stack.create_tenant(name, tpm=TPM), base_url=stack.base_url + "/v1",
                        max_retries=0, timeout=120)
    started = sdk.responses.create(model="default", input=COUNT, temperature=0, max_output_tokens=2_000,
                                   background=True)
    cancelled = sdk.responses.cancel(started.id)
    assert cancelled.id == started.id and cancelled.status == "cancelled"
    got = sdk.responses.retrieve(started.id)
    assert got.status == "cancelled" and got.usage is not None and got.usage.output_tokens < 2_000
    assert sdk.responses.cancel(started.id).status == "cancelled"  # a second cancel answers the same
    r = redis.Redis.from_url(stack.stack.redis_url)
    try:
        assert r.zcard(leases_key(name)) == 0  # the concurrency lease went with the run
        usage = {k.decode(): int(v)
                 for k, v in r.hgetall(usage_key(name, time.strftime("%Y%m%d", time.gmtime()))).items()}
        assert usage["requests"] == 1 and usage["completion_tokens"] == got.usage.output_tokens
        level, _ = bucket_level(r, name, TPM)
        # what was used is charged; the rest of prompt + 2,000 reserved came back
        assert level >= TPM - got.usage.input_tokens - got.usage.output_tokens - 1, level
    finally:
        r.close()
    other = openai.OpenAI(api_key=stack.batch_key, base_url=stack.base_url + "/v1", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(started.id)  # another tenant's id: not found, never forbidden
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(started.id)


def test_refusals_name_their_field(client):
    foreground = client.responses.create(model="default", input="hi", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(foreground.id)
    assert "'background': true" in err.value.body["message"] and foreground.id in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + "0" * 32)
    for extra, param in (({"background": True, "store": False}, "background"),
                         ({"background": True, "stream": True}, "stream"), ({"background": 1}, "background")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="default", input="hi", max_output_tokens=3, extra_body=extra)
        assert err.value.body["param"] == param
    for query, param in (({"stream": "true"}, "stream"), ({"starting_after": 3}, "starting_after"),
                         ({"frobnicate": 1}, "frobnicate")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.retrieve(foreground.id, extra_query=query)
        assert err.value.body["param"] == param
