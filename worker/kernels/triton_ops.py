"""A decoder layer's elementwise ops as one Triton kernel each on CUDA: RoPE in place, add + RMSNorm,
SiLU-mul, and fp8 per-row activation quantization (`worker.quant.fp8`).

The face of `worker.fused.EagerOps` (the reference). Fewer, larger kernels matter most inside decode CUDA
graphs, where a small model's step is bound by the number of kernels, not by bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from worker.kernels import triton_gemv
from worker.kernels.layer_ops import EagerOps, Rope


@triton.jit
def rotate_heads(x_ptr, t, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, N_ROT: tl.constexpr,
                 N_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token t's first N_ROT heads of x rotated in place by the fp32 tables at its position (fp32 math,
    rounded once); returns the head and lane indices and the rotated halves, for a caller that writes them
    elsewhere too."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, N_PAD)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * HALF + i, mask=i < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + i, mask=i < HALF, other=0.0)[None, :]
    mask = (h < N_ROT)[:, None] & (i < HALF)[None, :]
    p1 = x_ptr + t.to(tl.int64) * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(p1, r1, mask=mask)
    tl.store(p1 + HALF, r2, mask=mask)
    return h, i, r1, r2


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, N_ROT: tl.constexpr,
                 N_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    rotate_heads(x_ptr, tl.program_id(0), pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, N_ROT, N_PAD, HALF,
                 HALF_PAD)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps, H: tl.constexpr,
                         H_PAD: tl.constexpr, HAS_RES: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, H_PAD)
    mask = i < H
    x = tl.load(x_ptr + t * stride_x + i, mask=mask, other=0.0)
    if HAS_RES:  # x += residual, rounded to x's dtype as the eager in-place add does
        x = (x.to(tl.float32) + tl.load(res_ptr + t * stride_r + i, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + t * stride_x + i, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + i, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_in, stride_out, INTER: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < INTER
    g = tl.load(gu_ptr + t * stride_in + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_in + INTER + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + i, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _quant_rows_fp8_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K: tl.constexpr, K_PAD: tl.constexpr,
                           FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """One row: scale = max|x| / 448 (at least MIN_SCALE), codes = clamp(x / scale) as e4m3, rounded to
    nearest even; true divisions, so the codes are `worker.fp8.quantize_rows_fp8`'s bit for bit."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, K_PAD)
    x = tl.load(x_ptr + t * stride_x + i, mask=i < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), FP8_MAX), MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + t * stride_q + i, q.to(tl.float8e4nv), mask=i < K)
    tl.store(s_ptr + t, scale)


def quantize_rows_fp8(x: torch.Tensor, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> e4m3 codes [M, K] and fp32 scales [M, 1] in one kernel (the torch version takes about
    nine)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quant_rows_fp8_kernel[(m,)](x, q, scale, x.stride(0), q.stride(0), K=k,
                                     K_PAD=triton.next_power_of_2(k), FP8_MAX=fp8_max, MIN_SCALE=min_scale)
    return q, scale


class TritonOps(EagerOps):
    """RoPE reads the fp32 cos/sin tables by position and rotates q and k in place; norms and SiLU-mul compute
    in fp32 and round once; with `fused_linear`, decode-sized steps run them inside the projections that
    follow (`worker.kernels.triton_gemv`)."""

    def __init__(self, fused_linear: bool = False) -> None:
        self.fused_linear = fused_linear

    def norm_linear(self, x: torch.Tensor, pending: torch.Tensor | None, norm: nn.Module,
                    linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_linear and triton_gemv.fits(x, linear):
            return triton_gemv.norm_linear(x, pending, norm.weight, norm.eps, linear.weight)
        return super().norm_linear(x, pending, norm, linear)

    def norm_mlp(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, gate_up: nn.Module,
                 down: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_linear and triton_gemv.fits(x, gate_up) and triton_gemv.fits(x, down):
            x, gu = triton_gemv.norm_linear(x, residual, norm.weight, norm.eps, gate_up.weight)
            return x, triton_gemv.silu_mul_linear(gu, down.weight)
        return super().norm_mlp(x, residual, norm, gate_up, down)

    def prepare_rope(self, rope: Rope, dtype: torch.dtype) -> Rope:
        return rope

    def rope(self, qkv: torch.Tensor, n_rot: int, rope: Rope) -> torch.Tensor:
        t, _, hd = qkv.shape
        if t:
            half = hd // 2
            _rope_kernel[(t,)](qkv, rope.positions, rope.cos_table, rope.sin_table, qkv.stride(0),
                               qkv.stride(1), N_ROT=n_rot, N_PAD=triton.next_power_of_2(n_rot), HALF=half,
                               HALF_PAD=triton.next_power_of_2(half))
        return qkv[:, :n_rot]

    def attend(self, attn, layer: int, qkv: torch.Tensor, nh: int, rope: Rope, kv, meta) -> torch.Tensor:
        """On the Triton backend's model-dtype pages, RoPE and the K/V write are one kernel (the same
        bits)."""
        if getattr(attn, "name", "") == "triton" and not kv.quantized:
            return attn.forward_rope(layer, qkv, rope, kv, meta)
        return super().attend(attn, layer, qkv, nh, rope, kv, meta)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        return self._norm(x, residual, weight, eps)

    @staticmethod
    def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> torch.Tensor:
        t, h = x.shape
        out = torch.empty_like(x)
        if t:
            res = residual if residual is not None else x
            _add_rms_norm_kernel[(t,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
                                       H=h, H_PAD=triton.next_power_of_2(h), HAS_RES=residual is not None)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        t, two_i = gate_up.shape
        inter = two_i // 2
        out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
        if t:
            block = min(1024, triton.next_power_of_2(inter))
            _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                             INTER=inter, BLOCK=block)
        return out
