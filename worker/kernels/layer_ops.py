"""A decoder layer's elementwise ops: `EagerOps` (torch, the reference), `FusedOps` (one C++ pass each on CPU,
`csrc/fused_ops.cpp`) and `worker.triton_ops.TritonOps` (CUDA). `worker.model.backends` picks one
(`EngineConfig.fused_ops`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EagerOps", "FusedOps", "Rope"]
log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # the C++ fused ops' types
_NO_RESIDUAL = {dt: torch.empty(0, dtype=dt) for dt in KERNEL_DTYPES}


@dataclass(slots=True)
class Rope:
    """One step's rotary inputs: positions and the model's fp32 cos/sin tables [max_position, head_dim /
    2]."""

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    cos: torch.Tensor | None = None  # gathered [T, 1, hd/2] in the model dtype (eager only)
    sin: torch.Tensor | None = None


class EagerOps:
    """The reference: plain torch ops (the layer's original formulas)."""

    def prepare_rope(self, rope: Rope, dtype: torch.dtype) -> Rope:
        rope.cos = rope.cos_table[rope.positions].to(dtype)[:, None, :]
        rope.sin = rope.sin_table[rope.positions].to(dtype)[:, None, :]
        return rope

    def rope(self, qkv: torch.Tensor, n_rot: int, rope: Rope) -> torch.Tensor:
        """The first `n_rot` heads of qkv [T, heads, hd], rotated (a new tensor here; in place when fused)."""
        x = qkv[:, :n_rot]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        cos, sin = rope.cos, rope.sin
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def attend(self, attn, layer: int, qkv: torch.Tensor, nh: int, rope: Rope, kv, meta) -> torch.Tensor:
        """qkv [T, nh + 2 kvh, hd] -> attention output [T, nh * hd]: RoPE on q and k, then the backend writes
        this step's K/V and attends."""
        kvh = (qkv.shape[1] - nh) // 2
        qk = self.rope(qkv, nh + kvh, rope)
        return attn.forward(layer, qk[:, :nh], qk[:, nh:], qkv[:, nh + kvh:], kv, meta)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """x += residual (in place), then rms_norm(x) * weight."""
        x.add_(residual)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u

    def mlp(self, h: torch.Tensor, gate_up: nn.Module, down: nn.Module) -> torch.Tensor:
        """down(silu(gate) * up) of h."""
        return down(self.silu_mul(gate_up(h)))

    def norm_linear(self, x: torch.Tensor, pending: torch.Tensor | None, norm: nn.Module,
                    linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, linear(norm(x))), with `pending` added to x first (in place here; a fused op may return a new
        x)."""
        if pending is None:
            return x, linear(self.rms_norm(x, norm.weight, norm.eps))
        return x, linear(self.add_rms_norm_(x, pending, norm.weight, norm.eps))

    def norm_mlp(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, gate_up: nn.Module,
                 down: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, the MLP of its norm): the post-attention half of a layer."""
        return x, self.mlp(self.add_rms_norm_(x, residual, norm.weight, norm.eps), gate_up, down)


class FusedOps(EagerOps):
    """The same ops, one C++ pass each; only for a CPU model in bf16 or fp32 (`worker.model.backends.make_ops`
    decides once). The kernels check their inputs (contiguous, dtype) and raise rather than fall back."""

    def __init__(self, ext) -> None:
        self.ext = ext

    def prepare_rope(self, rope: Rope, dtype: torch.dtype) -> Rope:
        return rope  # the kernel reads the fp32 tables by position

    def rope(self, qkv: torch.Tensor, n_rot: int, rope: Rope) -> torch.Tensor:
        self.ext.rope_(qkv, rope.positions, rope.cos_table, rope.sin_table, n_rot)
        return qkv[:, :n_rot]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ext.add_rms_norm(x, _NO_RESIDUAL[x.dtype], weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        return self.ext.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ext.silu_mul(gate_up)

    def mlp(self, h: torch.Tensor, gate_up: nn.Module, down: nn.Module) -> torch.Tensor:
        """Where both linears take W8A8's large-row path: gate_up's sums go to `down`'s int8 codes in one pass
        (dequantize, SiLU·mul and quantize fused; the same bits as the three passes)."""
        rows = h.shape[0]
        g, d = _large_w8a8(gate_up, rows), _large_w8a8(down, rows)
        if g is None or d is None:
            return down(self.silu_mul(gate_up(h)))
        xq, row_scale = g.quantize(h)
        hq, h_scale = self.ext.w8a8_silu_mul_quantize(g.product(xq, rows), row_scale, g.col_scale,
                                                      d.inv_smooth, h, d.pad_rows(rows))
        return self.ext.w8a8_dequantize(d.product(hq, rows), h_scale, d.col_scale, h)


def _large_w8a8(lin: nn.Module, rows: int):
    """`lin`'s W8A8 weight where `rows` rows of it run the large-row int8 product, else None."""
    w = getattr(lin, "w8a8", None)
    if w is None or rows <= lin.max_rows or not w.large_rows(rows):
        return None
    return w
