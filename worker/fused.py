"""A decoder layer's elementwise ops, two ways: `EagerOps` (torch, the reference) and `FusedOps` (one C++ pass
each, `csrc/fused_ops.cpp`). The runner picks one per step (`EngineConfig.fused_ops`); both have one face.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

__all__ = ["EagerOps", "FusedOps", "Rope", "make_ops"]
log = logging.getLogger(__name__)

_NO_RESIDUAL = {dt: torch.empty(0, dtype=dt) for dt in (torch.bfloat16, torch.float32)}


class Rope:
    """One step's rotary inputs: positions and the model's fp32 cos/sin tables [max_position, head_dim / 2]."""

    __slots__ = ("positions", "cos_table", "sin_table", "cos", "sin")

    def __init__(self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
        self.positions, self.cos_table, self.sin_table = positions, cos_table, sin_table
        self.cos = self.sin = None  # gathered [T, 1, hd/2] in the model dtype (eager only)


class EagerOps:
    """The reference: plain torch ops (the layer's original formulas)."""

    name = "eager"

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


class FusedOps(EagerOps):
    """The same ops, one C++ pass each (CPU, bf16 or fp32); the eager ones otherwise."""

    name = "fused"

    def __init__(self, ext) -> None:
        self.ext = ext

    @staticmethod
    def _fits(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous()

    def prepare_rope(self, rope: Rope, dtype: torch.dtype) -> Rope:
        return rope if rope.positions.device.type == "cpu" else super().prepare_rope(rope, dtype)

    def rope(self, qkv: torch.Tensor, n_rot: int, rope: Rope) -> torch.Tensor:
        if rope.cos is not None or not self._fits(qkv):
            return super().rope(qkv, n_rot, rope)
        self.ext.rope_(qkv, rope.positions, rope.cos_table, rope.sin_table, n_rot)
        return qkv[:, :n_rot]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._fits(x) or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps)
        return self.ext.add_rms_norm(x, _NO_RESIDUAL[x.dtype], weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        if not self._fits(x) or weight.dtype != x.dtype or residual.dtype != x.dtype:
            return super().add_rms_norm_(x, residual, weight, eps)
        return self.ext.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self._fits(gate_up):
            return super().silu_mul(gate_up)
        return self.ext.silu_mul(gate_up)


def make_ops(fused: bool) -> EagerOps:
    """FusedOps when asked for and the C++ extension is built; EagerOps otherwise."""
    if fused:
        from worker.cpu_kernels import extension

        ext = extension()
        if ext is not None:
            return FusedOps(ext)
        log.warning("fused ops asked for, but the C++ extension is unavailable: using the eager torch ops")
    return EagerOps()
