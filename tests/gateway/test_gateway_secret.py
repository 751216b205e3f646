"""The public default prefix-hash secret is loudly warned about, except under `make run` (the launcher)."""

from __future__ import annotations

import logging

from config.cmd_gateway import DEV_STACK_ENV, warn_default_secret


def test_default_secret_warns_outside_make_run(caplog, monkeypatch):
    monkeypatch.delenv(DEV_STACK_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="switchyard.gateway"):
        warn_default_secret("switchyard-dev-secret")
        assert any("hash_secret" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
        caplog.clear()
        warn_default_secret("a-real-secret")
        monkeypatch.setenv(DEV_STACK_ENV, "1")
        warn_default_secret("switchyard-dev-secret")
        assert not caplog.records
