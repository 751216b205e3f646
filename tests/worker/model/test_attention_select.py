"""The attention backend rule (`worker.model.backends.choose_backend`): flash-attn's page-size constraint, the
Triton fallback on CUDA, torch on CPU, and clear errors for explicit choices that cannot run."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from worker.config import EngineConfig
from worker.model import backends
from worker.model.backends import choose_backend

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA machine as the rule sees it; `installed` says which of flash_attn / triton import."""
    installed = {"flash_attn", "triton"}
    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends.importlib.util, "find_spec",
                        lambda name, *a: object() if name in installed
                        else (None if name in ("flash_attn", "triton") else real(name, *a)))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return installed


def test_auto_takes_flash_attn_only_at_pages_of_256(fake_cuda):
    assert choose_backend("auto", CUDA, 256) == "flash_attn"
    assert choose_backend("auto", CUDA, 512) == "flash_attn"
    assert choose_backend("auto", CUDA, 16) == "triton"


def test_auto_falls_back_to_triton_then_torch(fake_cuda):
    fake_cuda.discard("flash_attn")
    assert choose_backend("auto", CUDA, 256) == "triton"
    fake_cuda.discard("triton")
    assert choose_backend("auto", CUDA, 256) == "torch"


def test_explicit_choices_that_cannot_run_say_why(fake_cuda):
    with pytest.raises(ValueError, match="multiple of 256"):
        choose_backend("flash_attn", CUDA, 16)
    with pytest.raises(ValueError, match="CUDA device"):
        choose_backend("triton", CPU, 16)  # no interpreter asked for
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend("flash", CUDA, 16)
    fake_cuda.discard("flash_attn")
    with pytest.raises(ValueError, match="flash-attn package"):
        choose_backend("flash_attn", CUDA, 256)


def test_cpu_auto_is_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend("auto", CPU, 16) == "torch"
    assert choose_backend("torch_reference", CPU, 16) == "torch_reference"


def test_config_and_cli_carry_the_choices():
    from config import cmd_worker

    EngineConfig(attention_backend="triton", cuda_graphs="off").validate()
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash").validate()
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="maybe").validate()
    parser = argparse.ArgumentParser()
    cmd_worker.add_arguments(parser)
    args = parser.parse_args(["--attention", "triton", "--cuda-graphs", "off", "--quantization", "fp8"])
    cfg = cmd_worker.engine_config(cmd_worker.settings_from_args(args).worker)
    assert (cfg.attention_backend, cfg.cuda_graphs, cfg.quantization) == ("triton", "off", "fp8")
