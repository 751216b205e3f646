"""W8A16 on AVX2: an int8 weight-only linear (the LM head) whose activation rows are quantized to int16 per row and
multiplied in `vpmaddwd` int16 products (csrc/w8a8_avx2.cpp `w8a16_avx2_linear`), where torch's int8 kernel
is slow; chosen per weight shape by `calibrate.calibrate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels.cpu import extension
from worker.quant.w8a8 import avx2_available

__all__ = ["MAX_IN_FEATURES", "A16Weight"]

# the widest input taking int16 rows: 12-bit codes at 4,128 features (exact int32 sums of K products with int8
# weights); below ~1,000 features they have 14 bits, finer than bf16's 8-bit mantissa everywhere
MAX_IN_FEATURES = 4128


@dataclass(slots=True)
class A16Weight:
    packed: torch.Tensor  # [out / 8, in / 4, 32] int8: the weight's transpose as `w8a8_avx2_pack` lays it out
    col_scale: torch.Tensor  # [out] fp32: the weight's per-channel scale

    @staticmethod
    def fits(qweight: torch.Tensor) -> bool:
        """The kernel was built and takes an int8 [out, in] weight of this shape."""
        out_features, in_features = qweight.shape
        return avx2_available() and in_features % 4 == 0 and out_features % 8 == 0 and in_features <= MAX_IN_FEATURES

    @classmethod
    def build(cls, qweight: torch.Tensor, scales: torch.Tensor) -> A16Weight | None:
        """From an int8 [out, in] weight and its per-channel scales; None where the kernel cannot take it."""
        if not cls.fits(qweight):
            return None
        packed = extension().w8a8_avx2_pack(qweight.t().contiguous())
        return cls(packed, scales.float().contiguous())

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        """[rows, in] bf16/fp32 -> [rows, out] of x2's dtype."""
        return extension().w8a16_avx2_linear(x2.contiguous(), self.packed, self.col_scale)
