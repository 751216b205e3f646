"""GatewayService.prepare: model checks, max_tokens rules, context limit, priority cap, cache namespace.

Runs the real service code with the real tokenizer; the router is built over a
static endpoint that is never started (prepare only reads its secret).
"""

from __future__ import annotations

import pytest

from common.priorities import Priority
from gateway.flow.served_model import ServedModel
from gateway.flow.service import GatewayService
from gateway.openai.schemas import parse_chat, parse_completion
from gateway.web.api_errors import ApiError
from router.dispatch import Router
from router.links.membership import Membership
from tenancy.directory import TenantDirectory
from tenancy.redis_client import async_client
from tenancy.schema import Tenant


@pytest.fixture(scope="module")
def service() -> GatewayService:
    membership = Membership(gateway_id="test", static_endpoints=["tcp://127.0.0.1:9"])
    router = Router(membership, secret=b"test-secret")
    # The directory is never queried here; the client connects lazily.
    return GatewayService(ServedModel.load("default"), TenantDirectory(async_client("redis://127.0.0.1:9/0")),
                          router)


def tenant(**kw) -> Tenant:
    return Tenant(name=kw.pop("name", "acme"), salt=kw.pop("salt", "s1"), **kw)


def chat(**kw):
    return parse_chat({"model": "default", "messages": [{"role": "user", "content": "hi"}], **kw})


def _err(fn) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn()
    return info.value


def test_prompt_is_the_chat_template(service):
    p = service.prepare(tenant(), chat(), "r1")
    assert p.prompt_ids == service.model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert p.shape.id.startswith("chatcmpl-") and p.shape.model == "default"


def test_stable_prefix_is_the_history_before_the_last_user_turn(service):
    tok = service.model.tokenizer
    history = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "Hello! 🎉"}]
    messages = [*history, {"role": "user", "content": "What is 2+2?"}]
    p = service.prepare(tenant(), chat(messages=messages), "r")
    assert p.prompt_ids == tok.apply_chat_template(messages)
    head = tok.apply_chat_template(history, add_generation_prompt=False)
    assert p.stable_len == len(head) and p.prompt_ids[: p.stable_len] == head
    assert service.prepare(tenant(), chat(), "r").stable_len == 0


def test_max_tokens_default_and_cap(service):
    t = tenant(default_max_tokens=77, max_tokens=100)
    assert service.prepare(t, chat(), "r").max_tokens == 77
    assert service.prepare(t, chat(max_tokens=100), "r").max_tokens == 100
    err = _err(lambda: service.prepare(t, chat(max_tokens=101), "r"))
    assert (err.status, err.param) == (400, "max_tokens")


def test_context_length_exceeded(service):
    ctx = service.model.max_context
    t = tenant(max_tokens=ctx * 2)
    req = parse_completion({"model": "default", "prompt": [1] * (ctx - 10), "max_tokens": 11})
    err = _err(lambda: service.prepare(t, req, "r"))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "prompt")
    ok = parse_completion({"model": "default", "prompt": [1] * (ctx - 10), "max_tokens": 10})
    assert service.prepare(t, ok, "r").max_tokens == 10
    # default max_tokens is clamped to the room left in the context
    near = parse_completion({"model": "default", "prompt": [1] * (ctx - 5)})
    assert service.prepare(t, near, "r").max_tokens == 5


def test_token_ids_outside_vocab(service):
    req = parse_completion({"model": "default", "prompt": [1, service.model.vocab_size]})
    err = _err(lambda: service.prepare(tenant(), req, "r"))
    assert (err.status, err.param) == (400, "prompt")


def test_unknown_and_forbidden_models(service):
    err = _err(lambda: service.prepare(tenant(), parse_chat(
        {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), "r"))
    assert (err.status, err.code) == (404, "model_not_found")
    err = _err(lambda: service.prepare(tenant(allowed_models=("other",)), chat(), "r"))
    assert (err.status, err.code) == (403, "model_not_allowed")
    allowed = tenant(allowed_models=(service.model.model_id,))
    assert service.prepare(allowed, chat(), "r").max_tokens > 0


def test_priority_capped_by_tenant_class(service):
    assert (service.prepare(tenant(priority=Priority.BATCH), chat(priority="interactive"), "r").priority
            == Priority.BATCH)
    assert service.prepare(tenant(), chat(priority="batch"), "r").priority == Priority.BATCH
    assert service.prepare(tenant(), chat(), "r").priority == Priority.INTERACTIVE


def test_namespace_differs_per_tenant_salt(service):
    a = service.prepare(tenant(salt="a"), chat(), "r").ns
    b = service.prepare(tenant(salt="b"), chat(), "r").ns
    assert a != b and a == service.prepare(tenant(salt="a", name="other"), chat(), "r").ns
