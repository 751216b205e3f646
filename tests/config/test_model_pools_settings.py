"""Model-pool settings: the worker's --model-version and --pool, the gateway's --model-pools and class
pools."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from config import cmd_gateway, cmd_worker
from config.settings import load_settings


def test_worker_announces_version_and_pool() -> None:
    parser = argparse.ArgumentParser()
    cmd_worker.add_arguments(parser)
    s = cmd_worker.settings_from_args(parser.parse_args(["--model-version", "v2", "--pool", "batch"]))
    assert (s.worker.model_version, s.worker.pool) == ("v2", "batch")
    assert (load_settings().worker.model_version, load_settings().worker.pool) == ("", "")
    with pytest.raises(ValidationError):
        load_settings(overrides={"worker": {"model_version": "v 2@x"}})


def test_gateway_model_pools_flag() -> None:
    parser = argparse.ArgumentParser()
    cmd_gateway.add_arguments(parser)
    s = load_settings(None, cmd_gateway.overrides_from_args(parser.parse_args(["--model-pools"])))
    assert s.gateway.model_pools and s.gateway.alias_poll_s <= 1.0
    assert not load_settings().gateway.model_pools
    assert load_settings().gateway.class_pools == {"interactive": "interactive", "batch": "batch"}
    with pytest.raises(ValidationError):
        load_settings(overrides={"gateway": {"alias_poll_s": 2}})
    with pytest.raises(ValidationError):
        load_settings(overrides={"gateway": {"class_pools": {"urgent": "x"}}})
