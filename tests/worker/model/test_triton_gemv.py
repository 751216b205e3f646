"""The fused decode projections (`worker.kernels.triton_gemv`) against the separate ops they replace, and a
model decoding the same tokens with them as without. Natively on CUDA; on CPU under Triton's interpreter
(small shapes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

pytest.importorskip("triton")

from worker.kernels import triton_gemv  # noqa: E402
from worker.kernels.triton_gemv import fits, norm_linear, silu_mul_linear  # noqa: E402

pytestmark = pytest.mark.triton_kernels
# (K, N) of norm_linear: SmolLM2-135M's qkv and gate/up, then sizes off the 64 and 16 blocks
NORM_SHAPES = ([(576, 960), (576, 3072), (200, 77)] if DEVICE.type == "cuda"
               else [(64, 40), (96, 48), (50, 33)])
# (I, N) of silu_mul_linear: its down projection, then odd sizes
SILU_SHAPES = [(1536, 576), (77, 50)] if DEVICE.type == "cuda" else [(64, 40), (33, 50)]


def _tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_linear_equals_add_norm_then_linear(dtype, rows, with_residual):
    torch.manual_seed(rows)
    for k, n in NORM_SHAPES:
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
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 64])
def test_silu_mul_linear_equals_silu_mul_then_linear(dtype, rows):
    torch.manual_seed(rows)
    for k, n in SILU_SHAPES:  # down: from the intermediate size back to the hidden size
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

    class Wrapped(torch.nn.Linear):  # a subclass (a quantized or adapted linear) may compute something else
        pass

    assert not fits(torch.zeros(3, 8), Wrapped(8, 4, bias=False))
    assert not fits(torch.zeros(3, 8), torch.nn.Linear(8, 4, bias=False).half())
    assert not fits(torch.zeros(8, 3).t(), lin)  # rows not contiguous


def _layer_parts(h: int, out: int, dtype: torch.dtype):
    from worker.model.llama import RMSNorm

    norm = RMSNorm(h, 1e-5)
    norm.weight.copy_(1 + 0.1 * torch.randn(h))
    lin = torch.nn.Linear(h, out, bias=False).requires_grad_(False)
    return norm.to(dtype), lin.to(dtype)


CPU_ONLY = pytest.mark.skipif(DEVICE.type == "cuda", reason="no device check: the CPU suite runs it")


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_ops_norm_linear_and_norm_mlp_are_the_separate_calls_bit_for_bit(dtype):
    """EagerOps (and the C++ FusedOps where built) keep today's sequence: x updated in place, the same
    bits."""
    from worker.kernels.layer_ops import EagerOps
    from worker.model.backends import make_ops

    torch.manual_seed(0)
    norm, qkv = _layer_parts(64, 96, dtype)
    gate_up = torch.nn.Linear(64, 256, bias=False).requires_grad_(False).to(dtype)
    down = torch.nn.Linear(128, 64, bias=False).requires_grad_(False).to(dtype)
    x0, pending = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    for ops in {type(o): o for o in (EagerOps(), make_ops(True, torch.device("cpu"), dtype))}.values():
        for p in (None, pending):
            x, want_x = x0.clone(), x0.clone()
            want = qkv(ops.rms_norm(want_x, norm.weight, norm.eps) if p is None
                       else ops.add_rms_norm_(want_x, p, norm.weight, norm.eps))
            got_x, got = ops.norm_linear(x, p, norm, qkv)
            assert got_x is x and torch.equal(x, want_x) and torch.equal(got, want)
        x, want_x = x0.clone(), x0.clone()
        want = ops.mlp(ops.add_rms_norm_(want_x, pending, norm.weight, norm.eps), gate_up, down)
        got_x, got = ops.norm_mlp(x, pending, norm, gate_up, down)
        assert got_x is x and torch.equal(x, want_x) and torch.equal(got, want)


def test_triton_ops_keep_the_separate_kernels_where_the_fused_ones_do_not_fit(monkeypatch):
    """Switched off, more than 64 rows, or a linear that is not a plain nn.Linear: the fused kernels never
    run."""
    from worker.kernels.triton_ops import TritonOps

    def refuse(*args, **kwargs):
        raise AssertionError("fused kernel called")

    monkeypatch.setattr(triton_gemv, "norm_linear", refuse)
    monkeypatch.setattr(triton_gemv, "silu_mul_linear", refuse)
    torch.manual_seed(0)
    norm, lin = (m.to(DEVICE) for m in _layer_parts(64, 128, torch.float32))
    down = torch.nn.Linear(64, 64, bias=False).requires_grad_(False).to(DEVICE)

    class Wrapped(torch.nn.Linear):
        pass

    odd = Wrapped(64, 128, bias=False).requires_grad_(False).to(DEVICE)
    for ops, rows, linear in ((TritonOps(fused_linear=False), 3, lin),
                              (TritonOps(fused_linear=True), 65, lin),
                              (TritonOps(fused_linear=True), 3, odd)):
        x = torch.randn(rows, 64, device=DEVICE)
        _, out = ops.norm_linear(x, torch.randn(rows, 64, device=DEVICE), norm, linear)
        assert out.shape == (rows, 128)
        _, out = ops.norm_mlp(x, torch.randn(rows, 64, device=DEVICE), norm, linear, down)
        assert out.shape == (rows, 64)


@CPU_ONLY  # config imports pydantic, which a bare GPU machine's python may lack
def test_fused_linear_knob_from_flag_to_engine_config_and_bad_values():
    import argparse

    from config import cmd_worker
    from worker.config import EngineConfig

    parser = argparse.ArgumentParser()
    cmd_worker.add_arguments(parser)

    def engine_config(*flags: str) -> EngineConfig:
        return cmd_worker.engine_config(cmd_worker.settings_from_args(parser.parse_args(list(flags))).worker)

    assert engine_config("--fused-linear", "on").fused_linear == "on"
    assert engine_config("--fused-linear", "off").fused_linear == "off"
    assert engine_config().fused_linear == "auto"
    with pytest.raises(ValueError, match="fused_linear"):
        EngineConfig(fused_linear="maybe").validate()
    with pytest.raises(SystemExit):
        parser.parse_args(["--fused-linear", "maybe"])


def test_a_model_forward_with_fused_projections_equals_the_eager_one():
    """A tiny random Llama's logits over a 20-token prompt: fused projections (and Triton norms) against the
    eager ops, fp32; and a CUDA engine decodes the same greedy tokens with them on as off."""
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


def test_greedy_decode_with_fused_projections_on_equals_off_fp32(monkeypatch):
    """A tiny random model decodes the same greedy tokens with the fused projections as with the separate
    Triton kernels (decode steps of 1 to 3 rows, prefills of 4 to 21): on CPU the engine's ops swapped for
    TritonOps."""
    from worker.config import EngineConfig
    from worker.engine.core import Engine
    from worker.kernels.triton_ops import TritonOps
    from worker.model.tiny_model import load_tiny_model
    from worker.protocol import SamplingParams

    loaded = load_tiny_model(dtype="float32", device=DEVICE, tokenizer=os.environ.get("SWITCHYARD_TOKENIZER",
                                                                                      "default"))
    prompts = [[5, 9, 11, 3, 7, 2, 8] * 3, [4, 4, 6, 1], [30, 31, 2, 7, 7]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    calls = []
    fused = triton_gemv.norm_linear
    monkeypatch.setattr(triton_gemv, "norm_linear", lambda x, *a: calls.append(x.shape[0]) or fused(x, *a))
    outs = []
    for on in (False, True):
        # cuda_graphs off: graphs would keep the ops they were captured with
        eng = Engine(loaded, EngineConfig(dtype="float32", kv_cache_bytes=16 << 20, kv_dtype="model",
                                          cuda_graphs="off"))
        eng.runner.ops, eng.runner.stack = TritonOps(fused_linear=on), None  # CPU: Triton's ops, no C++ stack
        outs.append(eng.generate(prompts, params))
        assert bool(calls) == on and (not on or min(calls) < 4)  # off: never; on: decode steps too
    assert outs[0] == outs[1] and all(len(o) == 6 for o in outs[0])


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
    # a bounded KV cache: the first engine's may outlive it (85% of the device)
    outs = [DebugEngine(loaded, EngineConfig(dtype="float32", kv_cache_bytes=256 << 20, max_num_seqs=16,
                                             fused_linear=mode)).generate(prompts, params)
            for mode in ("off", "on")]
    assert outs[0] == outs[1]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine's fused ops are Triton's on CUDA only")
def test_cuda_engine_greedy_smollm2_shape_fused_on_equals_off_fp32():
    """The default model's shape (random weights, fp32, decode CUDA graphs up to 16 rows): the same greedy
    tokens with the fused projections as with cuBLAS and the separate kernels."""
    from worker.config import EngineConfig, ModelConfig
    from worker.engine.core import Engine
    from worker.model.tiny_model import load_tiny_model, random_model
    from worker.protocol import SamplingParams

    tok = load_tiny_model(device="cpu", tokenizer=os.environ.get("SWITCHYARD_TOKENIZER", "default")).tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position=8192, tie_word_embeddings=True)
    loaded = random_model(cfg, dtype="float32", device=DEVICE, tokenizer=tok)
    prompts = [[(37 * i + 11 * n) % tok.vocab_size for i in range(n)] for n in (3, 17, 40, 64, 100, 9)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for mode in ("off", "on"):
        eng = Engine(loaded, EngineConfig(kv_cache_bytes=256 << 20, max_num_seqs=16, fused_linear=mode))
        assert eng.runner.ops.fused_linear == (mode == "on") and eng.runner.graphs is not None
        outs.append(eng.generate(prompts, params))
    assert outs[0] == outs[1]
