"""API keys' model scope, expiry and rotation as clients see them, over HTTP against real redis-server, worker
and gateway processes: 403 naming `model`, an expired key answered exactly as an unknown one, live edits and
rotation applied within 1 s, old key records unchanged."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from config.cli import main
from gateway.admin.project_keys import key_object
from tenancy import api_key_key, key_digest
from tenancy.redis_client import sync_client
from tenancy.tenant_admin import issue_key
from tests.gateway_stack import GatewayStack

pytestmark = pytest.mark.timeout(300)
BODY = {"model": "default", "prompt": "hi", "max_tokens": 1}


def complete(stack: GatewayStack, key: str, **body) -> httpx.Response:  # noqa: ANN003
    return httpx.post(stack.base_url + "/v1/completions", content=json.dumps({**BODY, **body}).encode(),
                      headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
                      timeout=60)


def models(stack: GatewayStack, key: str) -> int:
    return httpx.get(stack.base_url + "/v1/models", headers={"authorization": f"Bearer {key}"},
                     timeout=10).status_code


def wait_for_401(stack: GatewayStack, key: str, since: float, within_s: float) -> None:
    while models(stack, key) != 401:
        assert time.monotonic() - since < within_s, f"key still accepted after {within_s} s"
        time.sleep(0.05)


def test_a_scoped_key_gets_403_for_another_model_and_is_admitted_for_its_own(stack):
    r = sync_client(stack.stack.redis_url)
    other = issue_key(r, "acme", models="other-model")
    denied = complete(stack, other)
    assert denied.status_code == 403, denied.text
    err = denied.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_allowed" and "default" in err["message"]
    own = issue_key(r, "acme", models="default")
    assert complete(stack, own).status_code == 200
    r.close()


def test_an_expired_key_is_answered_exactly_like_an_unknown_one(stack):
    r = sync_client(stack.stack.redis_url)
    expired = issue_key(r, "acme", expires_at=time.time() - 1)
    unknown = "sy-" + "q" * 40
    for send in (complete, lambda s, k: httpx.get(s.base_url + "/v1/models",
                                                  headers={"authorization": f"Bearer {k}"})):
        a, b = send(stack, expired), send(stack, unknown)
        assert a.status_code == b.status_code == 401
        assert a.content == b.content and a.json()["error"]["code"] == "invalid_api_key"
    r.close()


def test_an_operator_edit_of_expires_at_applies_within_one_second(stack):
    r = sync_client(stack.stack.redis_url)
    key = issue_key(r, "acme")
    assert models(stack, key) == 200  # cached by the gateway now
    r.hset(api_key_key(key_digest(key)), "expires_at", f"{time.time() - 1:.3f}")
    wait_for_401(stack, key, time.monotonic(), 1.0)
    r.close()


def test_rotation_keeps_the_old_key_for_its_grace_only(stack, capsys):
    r = sync_client(stack.stack.redis_url)
    old = issue_key(r, "acme", models="default")
    assert models(stack, old) == 200
    url = stack.stack.redis_url
    assert main(["keys", "rotate", "acme", old[:10], "--grace", "2", "--redis-url", url]) == 0
    rotated_at = time.monotonic()
    new = capsys.readouterr().out.strip()
    assert new.startswith("sy-") and new != old
    assert complete(stack, old).status_code == 200 and complete(stack, new).status_code == 200
    assert complete(stack, new, model="other-model").status_code in (403, 404)  # the scope came along
    time.sleep(max(0.0, 1.5 - (time.monotonic() - rotated_at)))
    assert models(stack, old) == 200  # still inside the grace
    wait_for_401(stack, old, rotated_at, 3.0)  # the grace and the cache TTL
    assert models(stack, new) == 200
    r.close()


def test_an_old_key_record_without_scope_or_expiry_still_works(stack):
    r = sync_client(stack.stack.redis_url)
    key = "sy-" + "L" * 40
    r.hset(api_key_key(key_digest(key)), mapping={"tenant": "acme", "prefix": key[:10], "created_at": "1.0"})
    assert complete(stack, key).status_code == 200
    r.delete(api_key_key(key_digest(key)))
    r.close()


def test_the_admin_api_key_object_reports_expires_at():
    project = {"id": "p", "name": "p", "created_at": 1, "status": "active"}
    assert key_object("d", {b"prefix": b"sy-abc", b"expires_at": b"1767225600.5"}, project)[
        "expires_at"] == 1767225600
    assert key_object("d", {b"prefix": b"sy-abc"}, project)["expires_at"] is None
