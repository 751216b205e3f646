"""Decode-sized projections with their elementwise prologue fused in (Triton, CUDA): add + RMSNorm before a
linear (the input and post-attention norms with qkv and gate/up) and SiLU·mul before one (down), so a small
model's decode step launches three kernels fewer per layer. Rounding as the separate kernels round."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 64  # decode batches; larger steps keep cuBLAS
BLOCK_N, BLOCK_K = 16, 64  # a program per 16 output columns: N = 576 is still 36 programs
# 4 warps up to 16 rows, 8 above: with 4, a 64-row block spills registers (ptxas, sm_90)


@triton.jit
def _prologue(x_ptr, r_ptr, g_ptr, rows, cols, m_mask, k_mask, stride_x, stride_r, rstd, inter,
              MODE: tl.constexpr, HAS_RES: tl.constexpr):
    """The A operand's [BLOCK_M, BLOCK_K] block in fp32: normed (MODE 1) or SiLU·mul of gate and up (MODE
    2)."""
    mask = m_mask[:, None] & k_mask[None, :]
    if MODE == 1:
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_RES:  # the residual add, rounded to x's dtype as the in-place add rounds it
            x = (x.to(tl.float32) + tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask,
                                            other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        g = tl.load(g_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        return x.to(tl.float32) * rstd[:, None] * g[None, :]
    gate = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + rows[:, None] * stride_x + inter + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _fused_linear_kernel(x_ptr, r_ptr, g_ptr, w_ptr, out_ptr, new_x_ptr, M, N, K, stride_x, stride_r,
                         stride_w, stride_o, stride_nx, eps, MODE: tl.constexpr, HAS_RES: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    n_idx = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_idx < N
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if MODE == 1:  # the row's RMS over the whole (added) row first; program 0 writes the new residual stream
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
            if HAS_RES:
                x = (x.to(tl.float32) + tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask,
                                                other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            if HAS_RES and pid == 0:
                tl.store(new_x_ptr + rows[:, None] * stride_nx + cols[None, :], x, mask=mask)
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, 1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        # a: rounded once to the model dtype, as the kernels round
        a = _prologue(x_ptr, r_ptr, g_ptr, rows, cols, m_mask, k_mask, stride_x, stride_r, rstd, K, MODE,
                      HAS_RES).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + n_idx[None, :] * stride_w + cols[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)
        if UPCAST:  # Triton's interpreter gets 16-bit tl.dot wrong: the same products in fp32 there
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    tl.store(out_ptr + rows[:, None] * stride_o + n_idx[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _launch(x: torch.Tensor, res: torch.Tensor | None, gamma: torch.Tensor | None, weight: torch.Tensor,
            k: int, eps: float, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_x = torch.empty_like(x) if res is not None else x
    if m:
        block_m = max(16, triton.next_power_of_2(m))
        r = res if res is not None else x
        g = gamma if gamma is not None else weight
        _fused_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
            x, r, g, weight, out, new_x, m, n, k, x.stride(0), r.stride(0), weight.stride(0), out.stride(0),
            new_x.stride(0), eps, MODE=mode, HAS_RES=res is not None, IEEE=x.dtype == torch.float32,
            UPCAST=x.dtype != torch.float32 and bool(triton.knobs.runtime.interpret),
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4 if block_m <= 16 else 8)
    return new_x, out


def norm_linear(x: torch.Tensor, pending: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + pending, rms_norm(x + pending) * gamma @ weight.T): the new residual stream (a new tensor: the
    programs read x while program 0 writes) and the projection, in one kernel."""
    return _launch(x, pending, gamma, weight, x.shape[1], eps, mode=1)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for gate_up [M, 2I], in one kernel."""
    return _launch(gate_up, None, None, weight, gate_up.shape[1] // 2, 0.0, mode=2)[1]


def fits(x: torch.Tensor, linear: torch.nn.Module) -> bool:
    """A plain linear of a float dtype on contiguous decode-sized rows."""
    w = getattr(linear, "weight", None)
    return (type(linear) is torch.nn.Linear and linear.bias is None and w is not None and w.is_contiguous()
            and w.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dtype == w.dtype
            and x.dim() == 2 and x.is_contiguous() and x.shape[0] <= MAX_ROWS)
