"""The fused decode projections (`worker.kernels.triton_gemv`) against the separate ops they replace, and a model
decoding the same tokens with them as without. Natively on CUDA; on CPU under Triton's interpreter (small shapes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

pytest.importorskip("triton")

from worker.kernels.triton_gemv import fits, norm_linear, silu_mul_linear  # noqa: E402

pytestmark = pytest.mark.triton_kernels
SHAPES = [(576, 960), (1536, 576)] if DEVICE.type == "cuda" else [(64, 40), (96, 48)]


def _tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_linear_equals_add_norm_then_linear(dtype, rows, with_residual):
    torch.manual_seed(rows)
    for k, n in SHAPES:
        x = torch.randn(rows, k, device=DEVICE).to(dtype)
        pending = torch.randn(rows, k, device=DEVICE).to(dtype) if with_residual else None
        gamma = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
        w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
        added = x + pending if with_residual else x  # rounded to dtype, as the in-place add
        want = F.linear(F.rms_norm(added.float(), (k,), gamma.float(), 1e-5).to(dtype).float(), w.float())
        new_x, out = norm_linear(x, pending, gamma, 1e-5, w)
        if DEVICE.type == "cuda" or dtype == torch.float32:
            assert torch.equal(new_x, added)
        else:  # the interpreter's cast to bf16 truncates where CUDA rounds to nearest: one step at most
            torch.testing.assert_close(new_x, added, rtol=2 ** -7, atol=0)
        if not with_residual:
            assert new_x is x
        torch.testing.assert_close(out.float(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 33])
def test_silu_mul_linear_equals_silu_mul_then_linear(dtype, rows):
    torch.manual_seed(rows)
    for n, k in SHAPES:  # down: from the intermediate size back to the hidden size
        gate_up = torch.randn(rows, 2 * k, device=DEVICE).to(dtype)
        w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
        g, u = gate_up.float().chunk(2, dim=-1)
        want = F.linear((F.silu(g) * u).to(dtype).float(), w.float())
        torch.testing.assert_close(silu_mul_linear(gate_up, w).float(), want, **_tol(dtype))


def test_fits_only_plain_float_linears_on_decode_rows():
    lin = torch.nn.Linear(8, 4, bias=False)
    assert fits(torch.zeros(3, 8), lin)
    assert not fits(torch.zeros(65, 8), lin)  # a prefill step keeps cuBLAS
    assert not fits(torch.zeros(3, 8), torch.nn.Linear(8, 4))  # a bias
    assert not fits(torch.zeros(3, 8, dtype=torch.bfloat16), lin)  # dtypes differ


def test_a_model_forward_with_fused_projections_equals_the_eager_one():
    """A tiny random Llama's logits over a 20-token prompt: fused projections (and Triton norms) against the eager
    ops, fp32; and a CUDA engine decodes the same greedy tokens with them on as off."""
    from worker.kernels.triton_ops import TritonOps
    from worker.model.llama import reference_context
    from worker.model.tiny_model import load_tiny_model

    loaded = load_tiny_model(dtype="float32", device=DEVICE)
    ids = torch.tensor([5, 9, 11, 3, 7, 2, 8, 4, 4, 6, 1, 12, 30, 31, 2, 9, 5, 5, 7, 3], device=DEVICE)
    rows = torch.arange(len(ids), device=DEVICE)
    logits = {}
    for name, ops in (("eager", None), ("fused", TritonOps(fused_linear=True))):
        ctx = reference_context(loaded.model, len(ids), rows)
        if ops is not None:
            ctx.ops = ops
        logits[name] = loaded.model(ids, ctx)
    torch.testing.assert_close(logits["fused"], logits["eager"], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits["fused"].argmax(-1), logits["eager"].argmax(-1))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine's fused ops are Triton's on CUDA only")
def test_cuda_engine_greedy_tokens_equal_with_fused_projections_on_and_off():
    from worker.config import EngineConfig
    from worker.engine.debug import DebugEngine
    from worker.model.tiny_model import load_tiny_model
    from worker.protocol import SamplingParams

    loaded = load_tiny_model(dtype="float32", device=DEVICE, tokenizer=os.environ.get("SWITCHYARD_TOKENIZER",
                                                                                         "default"))
    prompts = [[5, 9, 11, 3, 7, 2, 8] * 3, [4, 4, 6, 1], [30, 31, 2]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = [DebugEngine(loaded, EngineConfig(dtype="float32", fused_linear=mode)).generate(prompts, params)
            for mode in ("off", "on")]
    assert outs[0] == outs[1]
