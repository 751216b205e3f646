"""The container files stay valid: compose parses, Dockerfiles name what the design card says."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests import REPO

DOCKER = REPO / "docker"


def compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(
        ["docker", "compose", "version"], capture_output=True
    ).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_config_parses() -> None:
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no docker compose client on this machine")
    out = subprocess.run(
        [*cmd, "-f", str(DOCKER / "compose.yaml"), "config", "--services"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"redis", "gateway", "worker-0", "worker-1"}


def test_dockerfiles_pin_torch_and_use_the_cli() -> None:
    gateway = (DOCKER / "Dockerfile.gateway").read_text()
    worker = (DOCKER / "Dockerfile.worker").read_text()
    assert "torch==2.13.0" in gateway and "torch==2.13.0" in worker
    assert '"switchyard", "gateway"' in gateway
    assert '"switchyard", "worker"' in worker and "[gpu]" in worker
    assert worker.startswith("#") and "FROM nvidia/cuda" in worker
