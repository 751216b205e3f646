"""Fused C++ elementwise ops against the eager torch reference: each op, greedy outputs of the default model
(identical in fp32), and the `fused_ops` knob from flag to engine."""

from __future__ import annotations

import argparse

import pytest
import torch

from config import cmd_worker
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.kernels.layer_ops import EagerOps, FusedOps, Rope
from worker.model.backends import make_ops
from worker.model.loader import load_model
from worker.protocol import SamplingParams


@pytest.fixture(scope="module")
def fused() -> FusedOps:
    ops = make_ops(True, torch.device("cpu"), torch.float32)
    assert isinstance(ops, FusedOps), "C++ extension failed to build (compiler missing?)"
    return ops


def test_fused_only_where_the_kernels_run():
    cpu = torch.device("cpu")
    assert isinstance(make_ops(True, cpu, torch.bfloat16), FusedOps)
    assert type(make_ops(True, cpu, torch.float16)) is EagerOps  # fp16 on CPU: eager (gathered RoPE tables)
    assert type(make_ops(False, cpu, torch.float32)) is EagerOps


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_each_op_matches_the_eager_reference(fused, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    eager = EagerOps()
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    r = torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.rand(96, generator=gen).to(dtype) + 0.5
    assert torch.allclose(fused.rms_norm(x, w, 1e-5).float(), eager.rms_norm(x, w, 1e-5).float(), atol=tol,
                          rtol=tol)
    xa, xb = x.clone(), x.clone()
    ha, hb = fused.add_rms_norm_(xa, r, w, 1e-5), eager.add_rms_norm_(xb, r, w, 1e-5)
    assert torch.equal(xa, xb)  # the residual stream is updated in place, rounded like `x + r`
    assert torch.allclose(ha.float(), hb.float(), atol=tol, rtol=tol)
    gu = torch.randn(7, 2 * 80, generator=gen).to(dtype) * 4
    assert torch.allclose(fused.silu_mul(gu).float(), eager.silu_mul(gu).float(), atol=tol, rtol=tol)
    qkv = torch.randn(7, 6, 32, generator=gen).to(dtype)
    pos = torch.tensor([0, 1, 5, 9, 100, 2047, 3])
    table = torch.rand(2048, 16, generator=gen) * 6
    rope_e = eager.prepare_rope(Rope(pos, table.cos(), table.sin()), dtype)
    want = eager.rope(qkv, 4, rope_e)
    got_qkv = qkv.clone()
    got = fused.rope(got_qkv, 4, fused.prepare_rope(Rope(pos, table.cos(), table.sin()), dtype))
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(got_qkv[:, 4:], qkv[:, 4:])  # heads past n_rot (the values) untouched
    if dtype == torch.float32:
        assert torch.equal(got, want)  # the same roundings as the eager formula


@pytest.mark.heavy  # quality gate / default-model end to end: `make test-heavy`, its own CI step
def test_greedy_outputs_identical_fused_and_eager_in_fp32():
    lm = load_model("default", dtype="float32", quantization="none")
    prompts = [lm.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                                "Once upon a time, in a land far away,")]
    outs = {}
    for mode in ("off", "on"):
        eng = Engine(lm, EngineConfig(kv_cache_bytes=64 << 20, fused_ops=mode))
        assert isinstance(eng.runner.ops, FusedOps) == (mode == "on")
        outs[mode] = eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert outs["on"] == outs["off"] and all(len(o) == 24 for o in outs["on"])


def test_knob_from_flag_to_engine_and_bad_values():
    parser = argparse.ArgumentParser()
    cmd_worker.add_arguments(parser)
    args = parser.parse_args(["--fused-ops", "off"])
    cfg = cmd_worker.engine_config(cmd_worker.settings_from_args(args).worker)
    assert cfg.fused_ops == "off"
    default = cmd_worker.settings_from_args(parser.parse_args([])).worker
    assert cmd_worker.engine_config(default).fused_ops == "on"
    with pytest.raises(ValueError, match="fused_ops"):
        EngineConfig(fused_ops="maybe").validate()
    with pytest.raises(SystemExit):
        parser.parse_args(["--fused-ops", "maybe"])
