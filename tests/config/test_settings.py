"""Settings precedence: CLI flags > SWITCHYARD_* environment > TOML file > defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from config import cmd_worker
from config.settings import load_settings


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_worker.add_arguments(parser)
    return parser.parse_args(argv)


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "sy.toml"
    toml.write_text('redis_url = "redis://file"\n[worker]\nbind = "tcp://file:1"\nmodel = "m-file"\n'
                    'drain_timeout = 7\n')
    monkeypatch.setenv("SWITCHYARD_WORKER__MODEL", "m-env")
    monkeypatch.setenv("SWITCHYARD_REDIS_URL", "redis://env")
    s = cmd_worker.settings_from_args(_parse(["--config", str(toml), "--bind", "tcp://cli:2"]))
    assert s.worker.bind == "tcp://cli:2"          # flag beats file
    assert s.worker.model == "m-env"               # env beats file
    assert s.redis_url == "redis://env"
    assert s.worker.drain_timeout == 7.0           # file beats default
    assert s.worker.gateway_timeout == 5.0         # default
    s2 = cmd_worker.settings_from_args(_parse(["--redis-url", "redis://cli", "--no-prefix-cache"]))
    assert s2.redis_url == "redis://cli" and s2.worker.enable_prefix_cache is False


def test_bad_values_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValidationError):
        load_settings(overrides={"worker": {"drain_timeout": -1}})
    with pytest.raises(ValidationError):
        load_settings(overrides={"worker": {"no_such_knob": 1}})
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.toml")


def test_engine_config_from_settings() -> None:
    s = cmd_worker.settings_from_args(_parse(["--block-size", "32", "--max-num-seqs", "8"]))
    cfg = cmd_worker.engine_config(s.worker)
    assert (cfg.block_size, cfg.max_num_seqs, cfg.enable_prefix_cache) == (32, 8, True)
    bad = cmd_worker.settings_from_args(_parse(["--block-size", "24"]))
    with pytest.raises(ValueError):
        cmd_worker.engine_config(bad.worker)


def test_gateway_routing_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    from config import cmd_gateway

    parser = argparse.ArgumentParser()
    cmd_gateway.add_arguments(parser)
    monkeypatch.setenv("SWITCHYARD_GATEWAY__ROUTE_PREFIX_TOKENS", "512")
    args = parser.parse_args(["--route-epsilon", "0.5", "--route-footprint-epsilon", "0"])
    s = load_settings(None, cmd_gateway.overrides_from_args(args))
    assert (s.gateway.route_epsilon, s.gateway.route_footprint_epsilon,
            s.gateway.route_prefix_tokens) == (0.5, 0, 512)
    assert (load_settings().gateway.route_epsilon,
            load_settings().gateway.route_footprint_epsilon) == (0.25, 0.1)
    with pytest.raises(ValidationError):
        load_settings(overrides={"gateway": {"route_epsilon": -0.1}})


def test_batch_concurrency_from_env_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().gateway.batch_concurrency == 4
    monkeypatch.setenv("SWITCHYARD_GATEWAY__BATCH_CONCURRENCY", "7")
    assert load_settings().gateway.batch_concurrency == 7
    with pytest.raises(ValidationError):
        load_settings(overrides={"gateway": {"batch_concurrency": 0}})
