"""int8 x int8 products through oneDNN's quantized linear (`torch.ops.onednn.qlinear_pointwise`), which runs
on AMX tiles where the CPU has them: the weight is prepacked once, and unit scales make it return the int32
accumulations as exact fp32 integers, so `w8a8_dequantize` gives the same bits as after `torch._int_mm`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["ROW_BUCKET", "OnednnInt8Weight", "available", "padded_rows"]

# oneDNN builds a kernel per row count on first sight (~1-3 ms per linear shape) and the worker bounds its
# cache at 256 kernels (worker.server.process.memory): rows are padded up to a multiple of 16 up to 128 rows,
# of 32 up to 512 and of 64 above (28 shapes per linear up to 1,024 rows, at most ~6% padding on average)
ROW_BUCKET = 16


@functools.cache
def available() -> bool:
    """torch has oneDNN's quantized linear and its AMX state could be enabled (or is not needed)."""
    ops = torch.ops.onednn
    if not (hasattr(ops, "qlinear_pointwise") and hasattr(ops, "qlinear_prepack")):
        return False
    init = getattr(torch._C._cpu, "_init_amx", None)
    if init is not None:
        # asks the kernel for AMX tile state; False only where the CPU has no AMX (oneDNN then uses VNNI)
        init()
    return True


def padded_rows(rows: int) -> int:
    step = ROW_BUCKET if rows <= 128 else 2 * ROW_BUCKET if rows <= 512 else 4 * ROW_BUCKET
    return -(-rows // step) * step


@dataclass(slots=True)
class OnednnInt8Weight:
    """A [in, out] int8 weight prepacked for oneDNN, with the unit scales and zero points its calls take."""

    packed: torch.Tensor
    ones: torch.Tensor  # [out] fp32: the weight scales (1: the products come back as integers)
    zeros: torch.Tensor  # [out] int64: the weight zero points

    @classmethod
    def pack(cls, wt: torch.Tensor) -> OnednnInt8Weight:
        k, n = wt.shape
        packed = torch.ops.onednn.qlinear_prepack(wt.t().contiguous(), [256, k])
        return cls(packed, torch.ones(n), torch.zeros(n, dtype=torch.long))

    def matmul(self, xq: torch.Tensor) -> torch.Tensor:
        """[m, k] int8 -> [m, n] fp32 holding the exact int32 products (|sum| < 2^24 for k <= 1,032; beyond,
        fp32 rounds the sum as `float(int32)` does, which is what the dequantize pass does to `_int_mm`'s)."""
        return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, self.packed, self.ones, self.zeros, None, 1.0,
                                                  0, torch.float32, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + 12 * self.ones.numel()
