"""`switchyard keys create|rotate|list` with model scopes, expiry and the key's dollar budget, on a real
redis-server."""

from __future__ import annotations

import time

import pytest

from admission.money.hierarchy import assign_project, set_budget
from admission.money.keys import config_key as money_config_key
from config.cli import main
from config.cmd_keys import duration_s
from tenancy import api_key_key, key_digest
from tenancy import tenant_admin as store

pytestmark = pytest.mark.timeout(60)


def keys(capsys, redis_url: str, *argv: str) -> tuple[int, str, str]:
    code = main(["keys", *argv, "--redis-url", redis_url])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_durations():
    assert [duration_s(t) for t in ("30d", "12h", "90m", "3600s", "3600", "1.5")] == [
        2_592_000, 43_200, 5_400, 3_600, 3_600, 1.5]
    for bad in ("", "1w", "-5", "d", "30 days"):
        with pytest.raises(ValueError, match="duration"):
            duration_s(bad)


def test_create_with_models_and_expiry_then_list(r, redis_url, capsys):
    store.create_tenant(r, "acme")
    code, out, err = keys(capsys, redis_url, "create", "acme", "--models", "m1,m2", "--expires-in", "30d")
    key = out.strip()
    assert code == 0 and err == "" and out == key + "\n" and key.startswith("sy-")
    fields = {k.decode(): v.decode() for k, v in r.hgetall(api_key_key(key_digest(key))).items()}
    assert fields["models"] == "m1,m2"
    assert float(fields["expires_at"]) == pytest.approx(time.time() + 30 * 86_400, abs=5)
    plain = keys(capsys, redis_url, "issue", "acme")[1].strip()
    r.hset(api_key_key(key_digest(plain)), "expires_at", "1000")
    code, out, _ = keys(capsys, redis_url, "list", "acme")
    rows = {line.split("…")[0]: line for line in out.splitlines()}
    assert code == 0 and "models=m1,m2" in rows[key[:10]] and "expires=20" in rows[key[:10]]
    assert "models=*" in rows[plain[:10]] and "(expired)" in rows[plain[:10]]
    code, _, err = keys(capsys, redis_url, "create", "acme", "--expires-in", "soon")
    assert code == 1 and "duration" in err


def test_rotate_prints_the_new_key_alone_and_copies_the_key_budget(r, redis_url, capsys):
    store.create_tenant(r, "shop")
    assign_project(r, "shop", "acme")
    old = store.issue_key(r, "shop", models="m1")
    set_budget(r, "acme", "key", key_digest(old), "5", "day")
    code, out, err = keys(capsys, redis_url, "rotate", "shop", old[:10], "--grace", "1h")
    new = out.strip()
    assert code == 0 and out == new + "\n" and new != old and "dollar budget" in err
    assert r.hget(api_key_key(key_digest(new)), "models") == b"m1"
    until = float(r.hget(api_key_key(key_digest(old)), "expires_at"))
    assert until == pytest.approx(time.time() + 3600, abs=5)
    assert r.hgetall(money_config_key("acme", "key", key_digest(new))) == {
        b"budget_micro": b"5000000", b"period": b"day"}
    code, _, err = keys(capsys, redis_url, "rotate", "shop", "sy-nothing")
    assert code == 1 and "no API key of tenant 'shop'" in err
