"""Dollar budgets through real gateways and the `openai` SDK: exact spend, the 429 insufficient_quota body."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from admission.money.hierarchy import assign_project, read_balance, read_spend, set_budget, set_limits
from admission.money.prices import set_price
from tenancy import key_digest
from tenancy.redis_client import sync_client
from tests.admission_stack import AdmissionStack

# two gateway processes and a worker: a long multi-process scenario, `make test-heavy` (its own CI step)
pytestmark = [pytest.mark.timeout(120), pytest.mark.heavy]


@pytest.fixture(scope="module")
def stack() -> Iterator[AdmissionStack]:
    s = AdmissionStack.start(gateways=2, gateway_settings={"money_budgets": True})
    try:
        s.warm_up(2)
        yield s
    finally:
        s.stop()


def test_organization_budget_is_exact_across_gateways_and_refuses_with_insufficient_quota(stack):
    r = sync_client(stack.redis.url)
    key = stack.create_tenant("shop", tpm=0, rpm=0, max_concurrent=0)
    assign_project(r, "shop", "acme")
    set_price(r, "*", "0", None, "1000")                    # output: 1000 micro-dollars a token, input free
    set_budget(r, "acme", "organization", "acme", "0.01", "day")
    time.sleep(1.1)                                          # every gateway's 1 s view of prices and orgs
    sdk = [openai.OpenAI(api_key=key, base_url=g.base_url + "/v1", max_retries=0, timeout=30)
           for g in stack.gateways]
    body = {"model": "default", "prompt": "Hello", "temperature": 0, "extra_body": {"ignore_eos": True}}
    raw = sdk[0].completions.with_raw_response.create(max_tokens=4, user="end-user-1", **body)
    assert raw.headers["x-budget-level"] == "organization"
    assert raw.headers["x-budget-remaining-usd"] == "0.006000"  # after holding 4 tokens' cost
    first = raw.parse()
    assert first.usage.completion_tokens == 4
    with pytest.raises(openai.RateLimitError) as exc:
        sdk[1].completions.create(max_tokens=7, **body)      # 4000 spent + 7000 held > 10000
    err = exc.value
    assert err.status_code == 429 and err.code == "insufficient_quota" and err.type == "insufficient_quota"
    assert "organization budget of $0.010000" in err.message and "resets at" in err.message
    assert 0 < int(err.response.headers["retry-after"]) <= 86_401  # a daily budget: waiting helps
    last = sdk[1].completions.create(max_tokens=6, **body)  # exactly the rest: no early refusal
    assert last.usage.completion_tokens == 6
    assert read_balance(r, "acme", "organization", "acme") == {"spent_micro": 10_000, "held_micro": 0}
    assert read_balance(r, "acme", "project", "shop") == {"spent_micro": 10_000, "held_micro": 0}
    (day,) = read_spend(r, "acme", 1).values()
    assert day["org|cost_micro"] == 10_000 and day["org|requests"] == 2
    assert day["user:shop/end-user-1|cost_micro"] == 4000 and day["org|output_tokens"] == 10
    r.close()


def test_cancelled_stream_pays_for_the_tokens_it_got_and_frees_its_hold(stack):
    r = sync_client(stack.redis.url)
    key = stack.create_tenant("streamer", tpm=0, rpm=0, max_concurrent=0)
    assign_project(r, "streamer", "beta")
    set_price(r, "*", "0", None, "1000")
    set_budget(r, "beta", "project", "streamer", "1", "day")
    time.sleep(1.1)
    client = openai.OpenAI(api_key=key, base_url=stack.gateways[0].base_url + "/v1", max_retries=0,
                           timeout=30)
    stream = client.completions.create(model="default", prompt="Hello", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()                                           # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while read_balance(r, "beta", "project", "streamer")["held_micro"] and time.monotonic() < deadline:
        time.sleep(0.05)
    bal = read_balance(r, "beta", "project", "streamer")
    (day,) = read_spend(r, "beta", 1).values()
    assert bal["held_micro"] == 0 and 0 < bal["spent_micro"] < 400_000
    assert bal["spent_micro"] == day["org|cost_micro"] == day["org|output_tokens"] * 1000
    r.close()


def test_key_rpm_and_a_project_model_budget_refuse_naming_their_level(stack):
    r = sync_client(stack.redis.url)
    key = stack.create_tenant("limited", tpm=0, rpm=0, max_concurrent=0)
    assign_project(r, "limited", "gamma")
    set_price(r, "*", "0", None, "1000")
    set_limits(r, "gamma", "key", key_digest(key), rpm=1)
    time.sleep(1.1)
    client = openai.OpenAI(api_key=key, base_url=stack.gateways[0].base_url + "/v1", max_retries=0,
                           timeout=30)
    body = {"model": "default", "prompt": "Hello", "max_tokens": 2, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**body)
    with pytest.raises(openai.RateLimitError) as exc:
        client.completions.create(**body)
    err = exc.value
    assert err.code == "rate_limit_exceeded" and err.type == "requests"
    assert "key requests per minute: limit 1" in err.message
    assert err.response.headers["x-ratelimit-level"] == "key"
    assert int(err.response.headers["retry-after"]) >= 1
    set_limits(r, "gamma", "key", key_digest(key), rpm=0)
    set_budget(r, "gamma", "project", "limited", "0.001", "day", model=first.model)  # a day's period: from 0
    with pytest.raises(openai.RateLimitError) as exc:
        client.completions.create(**body)
    assert exc.value.code == "insufficient_quota"
    assert f"project (model {first.model}) budget of $0.001000" in exc.value.message
    assert client.completions.create(**{**body, "max_tokens": 1}).usage.completion_tokens == 1
    assert read_balance(r, "gamma", "key", key_digest(key))["held_micro"] == 0
    r.close()
