"""fp8 (e4m3) weights: quantization error bounds, the emulated layer against a written-out reference, the tiny
model quantized; on CUDA devices of capability 8.9+ (`gpu` marker) `torch._scaled_mm` against the emulation.

Self-contained (torch and the worker package): the GPU tests also run with `--noconftest`, without redis or
the default model file (the tiny model is built from its seeded weights, no tokenizer).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from worker.model.build import build_model
from worker.model.llama import LlamaModel
from worker.model.tiny_model import TINY_SEED, random_tensors, tiny_config
from worker.quant import fp8
from worker.quant import weights as quant

VOCAB = 49152  # the default tokenizer's, so this is the `tiny-random` model's shape


def _fp8_cuda() -> bool:
    return torch.cuda.is_available() and fp8.device_supported(torch.device("cuda"))


needs_fp8_gpu = pytest.mark.skipif(not _fp8_cuda(), reason="needs a CUDA device of compute capability 8.9+")


def _weight(out: int, inp: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Rows of very different ranges, a few outliers and one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.logspace(-4, 1, out)[:, None]
    w[3, 7] *= 40
    w[5] = 0
    return w.to(dtype)


def _reference(lin: fp8.Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """Written out: per-row e4m3 activations times the dequantized weight, all in fp32 (the output
    unrounded)."""
    xf = x.reshape(-1, x.shape[-1]).float()
    sx = (xf.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    xd = (xf / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sx
    w = lin.qweight.float() * lin.wscale[:, None]
    return (xd @ w.t()).reshape(*x.shape[:-1], lin.out_features)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantize_error_bound_and_exact_round_trip():
    w = _weight(96, 576)
    q, s = fp8.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (96,)
    d = fp8.dequantize_fp8(q, s)
    assert torch.isfinite(d).all() and not d[5].any()  # the zero row: zero codes, a finite scale
    codes = q.float().abs().amax(1)
    assert (codes[torch.arange(96) != 5] == 448).all()  # every row uses the full range
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (subnormals: half their spacing 2^-9)
    err = (w - d).abs()
    assert (err <= w.abs() / 16 + s[:, None] * 2**-10).all()
    # per row at most half the top binade's spacing (16 codes of 448): 1/28 of the row's max |w|
    amax = w.abs().amax(1)
    assert (err.amax(1) <= amax / 28 * (1 + 1e-6)).all()
    # the dequantized weight is representable exactly: quantizing it again changes nothing
    q2, s2 = fp8.quantize_fp8(d)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    assert torch.equal(fp8.dequantize_fp8(q2, s2), d)


def test_rows_use_the_weight_quantization():
    x = _weight(7, 576, torch.bfloat16, seed=1)
    xq, sx = fp8.quantize_rows_fp8(x)
    q, s = fp8.quantize_fp8(x)
    assert sx.shape == (7, 1) and sx.dtype == torch.float32
    assert torch.equal(xq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sx[:, 0], s)


@pytest.mark.parametrize("lead", [(1,), (7,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_matches_dequantized_reference(dtype, lead):
    torch.manual_seed(0)
    w = (torch.randn(192, 576) * 0.05).to(dtype)
    lin = fp8.Fp8Linear(w)
    assert (lin.out_features, lin.in_features, lin.dtype) == (192, 576, dtype)
    assert lin.qweight.dtype == torch.float8_e4m3fn and lin.wscale.dtype == torch.float32
    assert torch.equal(lin.dequantize(), lin.qweight.float() * lin.wscale[:, None])
    x = torch.randn(*lead, 576).to(dtype)
    y = lin(x)
    assert y.shape == (*lead, 192) and y.dtype == dtype
    ref = _reference(lin, x)
    tol = 1e-5 * ref.abs().max()  # summation order only
    if dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2**-8  # and the output's rounding to bf16
    assert ((y.float() - ref).abs() <= tol).all()
    exact = x.float() @ w.float().t()
    assert _rel(y, exact) < 0.06  # e4m3 weights and activations: ~3.5% measured


def test_extra_repr_and_buffers():
    lin = fp8.Fp8Linear(torch.randn(64, 32, dtype=torch.bfloat16))
    assert repr(lin) == "Fp8Linear(32, 64, fp8=e4m3, dtype=bfloat16)"
    assert set(dict(lin.named_buffers())) == {"qweight", "wscale"} and not list(lin.parameters())


def test_resolve_mode_fp8_needs_ada_or_hopper(monkeypatch):
    assert "fp8" in quant.CHOICES
    for dev in ("cpu", "meta"):
        with pytest.raises(ValueError, match="fp8 needs a CUDA device of compute capability 8.9 or newer"):
            quant.resolve_mode("fp8", torch.device(dev))
    # a pretend CUDA device: Ampere refused, Hopper accepted; auto stays unquantized on CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fp8, "_capability", lambda index: (8, 6))
    with pytest.raises(ValueError, match="8.9 or newer"):
        quant.resolve_mode("fp8", cuda)
    monkeypatch.setattr(fp8, "_capability", lambda index: (9, 0))
    assert quant.resolve_mode("fp8", cuda) == "fp8"
    assert quant.resolve_mode("auto", cuda) == "none"


def _tiny(dtype: torch.dtype, device: str) -> LlamaModel:
    cfg = tiny_config(VOCAB, None, None)
    return build_model(cfg, random_tensors(cfg, TINY_SEED), dtype, torch.device(device))


@torch.inference_mode()
def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """fp32 logits of every position of one prefill through the reference attention and eager ops."""
    from worker.model.llama import reference_context

    n, dev = len(ids), model.embed.weight.device
    ctx = reference_context(model, n, torch.arange(n, device=dev))
    return model(torch.tensor(ids, device=dev), ctx).float().cpu()

PROMPT = [(i * 7919) % VOCAB for i in range(48)]


def test_tiny_model_quantized_to_fp8():
    base = _tiny(torch.float32, "cpu")
    model = copy.deepcopy(base)
    quant.quantize_model(model, "fp8")
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            assert isinstance(lin, fp8.Fp8Linear) and lin.dtype == torch.float32
    assert type(model.lm_head) is nn.Linear and type(model.embed) is nn.Embedding  # model dtype
    assert model.lm_head.weight is model.embed.weight
    lins = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    saved = sum(lin.qweight.numel() * 3 - lin.out_features * 4 for lin in lins)  # fp32 -> 1 byte + scales
    assert quant.weight_bytes(model) == quant.weight_bytes(base) - saved
    want, got = _logits(base, PROMPT), _logits(model, PROMPT)
    assert torch.isfinite(got).all()
    # a random model amplifies errors layer by layer: measured x0.18 and 67% (int8 here: 0.03, 96%; int4:
    # 0.40, 33%); default model's perplexity gate: tests/worker/quant/test_quantization.py
    assert _rel(got, want) < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.5


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("m", [1, 7, 64])
def test_scaled_mm_matches_emulation(m):
    torch.manual_seed(m)
    w = (torch.randn(960, 576) * 0.05).to(torch.bfloat16)
    lin = fp8.Fp8Linear(w.cuda())
    cpu = fp8.Fp8Linear(w)
    # the very same quantization on both devices: weight codes and scales, activation codes and scales
    assert torch.equal(lin.qweight.cpu().view(torch.uint8), cpu.qweight.view(torch.uint8))
    assert torch.equal(lin.wscale.cpu(), cpu.wscale)
    x = torch.randn(m, 576, dtype=torch.bfloat16)
    xq, sx = fp8.quantize_rows_fp8(x.cuda())
    xq_cpu, sx_cpu = fp8.quantize_rows_fp8(x)
    assert torch.equal(xq.cpu().view(torch.uint8), xq_cpu.view(torch.uint8)) and torch.equal(sx.cpu(), sx_cpu)
    y = lin(x.cuda())
    assert y.dtype == torch.bfloat16 and y.shape == (m, 960)
    assert torch.equal(y, lin._scaled_mm(xq, sx, torch.bfloat16))  # the layer took the device path
    ref = _reference(cpu, x)  # fp32, unrounded
    emulated = cpu(x).float()
    tol = ref.abs() * 2**-7 + 1e-4 * ref.abs().max()  # bf16 rounding of either, and summation order
    assert ((y.float().cpu() - ref).abs() <= tol).all()
    assert ((y.float().cpu() - emulated).abs() <= tol).all()
    # fp32 and leading dimensions: computed in bf16 on the device, returned in fp32
    y32 = lin(x.cuda().float().view(1, m, 576))
    assert y32.dtype == torch.float32 and y32.shape == (1, m, 960)
    assert ((y32.cpu()[0] - ref).abs() <= tol).all()


@pytest.mark.gpu
@needs_fp8_gpu
def test_tiny_model_fp8_on_cuda_matches_cpu_emulation():
    logits = {}
    for device in ("cuda", "cpu"):
        model = _tiny(torch.bfloat16, device)
        quant.quantize_model(model, "fp8")
        logits[device] = _logits(model, PROMPT)
    assert quant.resolve_mode("fp8", torch.device("cuda")) == "fp8"
    got, want = logits["cuda"], logits["cpu"]
    rel, agree = _rel(got, want), (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"tiny model, fp8 on CUDA vs CPU emulation (bf16): x{rel:.4f} apart, top-1 agreement {agree:.3f}")
    assert torch.isfinite(got).all()
    # summation order and bf16 rounding flip a few activation codes, and the random model amplifies each flip:
    # measured x0.057 and 96% on an H200 (float model, CUDA vs CPU: x0.008; fp8 vs float on CPU: x0.18)
    assert rel < 0.1
    assert agree >= 0.85
