"""W8A16: an int8 weight-only linear (the LM head) whose activation rows are quantized to int16 per row and
multiplied with exact integer sums, where torch's int8 kernel (or the dequantized bf16 product) is slower: on
AVX-512 VNNI as two unsigned bytes a code (csrc/w8a8_small.cpp `w8a16_small_linear`), else in AVX2 `vpmaddwd`
int16 products (csrc/w8a8_avx2.cpp `w8a16_avx2_linear`). Both give the same bits; chosen per weight shape by
`calibrate.calibrate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels.cpu import extension
from worker.quant.w8a8 import avx2_available, small_available

__all__ = ["KINDS", "MAX_IN_FEATURES", "A16Weight"]

# the widest input taking int16 rows: 12-bit codes at 4,128 features (exact int32 sums of K products with int8
# weights); below ~1,000 features they have 14 bits, finer than bf16's 8-bit mantissa everywhere
MAX_IN_FEATURES = 4128
KINDS = ("vnni", "avx2")
_LANES = {"vnni": 16, "avx2": 8}  # output channels per packed block


@dataclass(slots=True)
class A16Weight:
    # the weight's transpose packed for the kernel: vnni [out / 16, in / 4, 64] int8, avx2 [out / 8, in / 4,
    # 32]
    packed: torch.Tensor
    col_scale: torch.Tensor  # [out] fp32: the weight's per-channel scale
    colsum: torch.Tensor | None = None  # vnni: [out] int32 column sums of the packed weight
    kind: str = "avx2"

    @staticmethod
    def pick(qweight: torch.Tensor) -> str | None:
        """The kernel for an int8 [out, in] weight: VNNI where built and the shape fits, else AVX2; None:
        neither."""
        return next((k for k in KINDS if A16Weight.fits(qweight, k)), None)

    @staticmethod
    def fits(qweight: torch.Tensor, kind: str | None = None) -> bool:
        """`kind`'s kernel (None: either) was built and takes an int8 [out, in] weight of this shape."""
        if kind is None:
            return A16Weight.pick(qweight) is not None
        out_features, in_features = qweight.shape
        built = small_available() if kind == "vnni" else avx2_available()
        return (built and in_features % 4 == 0 and out_features % _LANES[kind] == 0
                and in_features <= MAX_IN_FEATURES)

    @classmethod
    def build(cls, qweight: torch.Tensor, scales: torch.Tensor, kind: str | None = None) -> A16Weight | None:
        """From an int8 [out, in] weight and its per-channel scales; None where the kernel cannot take it."""
        kind = kind or cls.pick(qweight)
        if kind is None or not cls.fits(qweight, kind):
            return None
        wt = qweight.t().contiguous()
        if kind == "vnni":
            packed, colsum = extension().w8a8_small_pack(wt)
            return cls(packed, scales.float().contiguous(), colsum, kind)
        return cls(extension().w8a8_avx2_pack(wt), scales.float().contiguous(), None, kind)

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        """[rows, in] bf16/fp32 -> [rows, out] of x2's dtype."""
        if self.kind == "vnni":
            return extension().w8a16_small_linear(x2.contiguous(), self.packed, self.colsum, self.col_scale)
        return extension().w8a16_avx2_linear(x2.contiguous(), self.packed, self.col_scale)
