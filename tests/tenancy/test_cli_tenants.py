"""The `switchyard tenants|keys|usage` commands, run as real subprocesses against the test Redis."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import pytest

from tenancy.redis_client import sync_client
from tenancy.schema import config_key, usage_key
from tests import REPO

pytestmark = pytest.mark.timeout(60)
ROOT = REPO


def cli(*args: str, url: str | None = None, env_url: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SWITCHYARD_REDIS_URL"}
    if env_url:
        env["SWITCHYARD_REDIS_URL"] = env_url
    argv = [sys.executable, "-m", "config.cli", *args] + (["--redis-url", url] if url else [])
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)


def test_tenant_and_key_lifecycle(redis_url):
    out = cli("tenants", "create", "acme", "--tpm", "5000", "--rpm", "30", "--max-concurrent", "4",
              "--max-tokens", "1024", "--default-max-tokens", "128", "--priority", "batch", "--models",
              "m1,m2", url=redis_url)
    assert out.returncode == 0, out.stderr
    r = sync_client(redis_url)
    cfg = {k.decode(): v.decode() for k, v in r.hgetall(config_key("acme")).items()}
    assert {k: cfg[k] for k in ("tpm", "rpm", "max_concurrent", "max_tokens", "default_max_tokens",
                                "priority", "allowed_models", "status")} == {
        "tpm": "5000", "rpm": "30", "max_concurrent": "4", "max_tokens": "1024", "default_max_tokens": "128",
        "priority": "batch", "allowed_models": "m1,m2", "status": "active"}

    assert cli("tenants", "create", "acme", url=redis_url).returncode == 1  # exists
    out = cli("tenants", "set", "acme", "--tpm", "9000", env_url=redis_url)  # env var works too
    assert out.returncode == 0 and r.hget(config_key("acme"), "tpm") == b"9000"

    key = cli("keys", "issue", "acme", url=redis_url)
    assert key.returncode == 0 and key.stderr == ""
    k1 = key.stdout.strip()
    assert key.stdout == k1 + "\n" and k1.startswith("sy-") and len(k1) == 43  # the key alone
    k2 = cli("keys", "issue", "acme", url=redis_url).stdout.strip()

    listed = cli("tenants", "list", url=redis_url)
    assert listed.returncode == 0
    row = [line.split() for line in listed.stdout.splitlines() if line.startswith("acme")][0]
    # weight 1, two keys
    assert row[:4] == ["acme", "active", "batch", "9000"] and row[8] == "1" and row[9] == "2"

    ambiguous = cli("keys", "revoke", "sy-", url=redis_url)
    assert ambiguous.returncode == 1 and "give a longer prefix" in ambiguous.stderr
    revoked = cli("keys", "revoke", k1[:10], url=redis_url)
    assert revoked.returncode == 0 and "acme" in revoked.stdout
    assert k1 not in revoked.stdout + revoked.stderr
    keys = cli("keys", "list", "acme", url=redis_url).stdout
    assert k2[:10] in keys and k1[:10] not in keys

    assert cli("tenants", "disable", "acme", url=redis_url).returncode == 0
    assert r.hget(config_key("acme"), "status") == b"disabled"
    assert cli("tenants", "enable", "acme", url=redis_url).returncode == 0
    assert r.hget(config_key("acme"), "status") == b"active"
    r.close()


def test_errors_are_clear(redis_url):
    missing = cli("tenants", "list")
    assert missing.returncode == 2 and "SWITCHYARD_REDIS_URL" in missing.stderr
    bad = cli("tenants", "create", "acme", "--tpm", "-5", url=redis_url)
    assert bad.returncode == 1 and "tpm must be a non-negative integer" in bad.stderr
    assert "nope" in cli("keys", "issue", "nope", url=redis_url).stderr
    down = cli("tenants", "list", url="redis://127.0.0.1:1/0")
    assert down.returncode == 1 and "Redis unreachable" in down.stderr


def test_usage_command(redis_url):
    assert cli("tenants", "create", "acme", url=redis_url).returncode == 0
    r = sync_client(redis_url)
    today = dt.datetime.now(dt.UTC).date()
    yesterday = today - dt.timedelta(days=1)
    r.hset(usage_key("acme", today.strftime("%Y%m%d")),
           mapping={"requests": 3, "prompt_tokens": 30, "cached_tokens": 8, "completion_tokens": 12})
    r.hset(usage_key("acme", yesterday.strftime("%Y%m%d")),
           mapping={"requests": 1, "prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 7})
    r.close()
    out = cli("usage", "acme", "--days", "3", "--json", url=redis_url)
    assert out.returncode == 0, out.stderr
    days = json.loads(out.stdout)
    assert [d["day"] for d in days] == [(today - dt.timedelta(days=i)).isoformat() for i in (2, 1, 0)]
    assert [d["requests"] for d in days] == [0, 1, 3] and days[2]["cached_tokens"] == 8
    table = cli("usage", "acme", url=redis_url).stdout.splitlines()
    assert table[-1].split() == ["total", "4", "35", "8", "19"]
    assert cli("usage", "ghost", url=redis_url).returncode == 1
