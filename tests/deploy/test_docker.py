"""The container files stay valid: compose parses, Dockerfiles name what the design card says."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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


def _warm_snippets() -> dict[str, str]:
    """The `python -c` cache-warming step of each Dockerfile (line continuations joined)."""
    out = {}
    for name in ("Dockerfile.gateway", "Dockerfile.worker"):
        text = (DOCKER / name).read_text().replace("\\\n", "")
        line = next(ln for ln in text.splitlines() if ln.startswith('RUN python -c "'))
        out[name] = line[len('RUN python -c "'):line.rindex('"')]
    return out


def test_images_warm_the_model_caches_as_the_runtime_user() -> None:
    for name, code in _warm_snippets().items():
        compile(code, name, "exec")
        text = (DOCKER / name).read_text()
        assert text.index("USER switchyard") < text.index('RUN python -c "'), name  # the cache in its home
    assert "read_index" in _warm_snippets()["Dockerfile.worker"]


@pytest.mark.heavy
def test_the_warming_steps_fill_the_caches(tmp_path) -> None:
    env = {**os.environ, "SWITCHYARD_CACHE": str(tmp_path)}
    for code in _warm_snippets().values():
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300, cwd=REPO)
    assert list((tmp_path / "switchyard" / "tokenizers").glob("*/tokenizer.json"))
    assert list((tmp_path / "switchyard" / "gguf").glob("*.json"))
