"""`switchyard redis migrate-keys` on one Redis: legacy untagged keys move (TTL kept, sets merged), once."""

from __future__ import annotations

import pytest

from tenancy.migrate import migrate_keys
from tenancy.redis_client import sync_client
from tests.cluster.test_cluster_cli import check_migrated, seed_legacy_keys
from tests.tenancy.test_cli_tenants import cli

pytestmark = pytest.mark.timeout(60)


def test_migrate_keys_moves_merges_and_is_idempotent(redis_url) -> None:
    r = sync_client(redis_url)
    try:
        seed_legacy_keys(r)
        report = migrate_keys(r)
        assert len(report.moved) == 2 and len(report.merged) == 1 and report.superseded == []
        check_migrated(r)
        assert migrate_keys(r).total == 0
    finally:
        r.close()


def test_migrate_keys_command_and_newer_records_win(redis_url) -> None:
    r = sync_client(redis_url)
    try:
        r.set("sy:worker:w9", b"old")
        r.set("{sy:workers}:worker:w9", b"new")
        out = cli("redis", "migrate-keys", url=redis_url)
        assert out.returncode == 0 and "newer key kept" in out.stdout, out.stdout + out.stderr
        assert r.get("{sy:workers}:worker:w9") == b"new" and not r.exists("sy:worker:w9")
    finally:
        r.close()
