"""W8A8 linears for prefill-sized products: int8 activations (per row) times int8 weights on the CPU's int8
dot units (`torch._int_mm`), with SmoothQuant's per-channel factors moving activation outliers into the
weights.

Factors come from the activation maxima of each linear's input over a shipped calibration text
(`data/calibration.txt`, not the quality gate's text), measured once at load on the unquantized model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from worker.kernels.cpu import extension
from worker.kernels.cpu_features import has_int8_dot
from worker.quant.onednn_int8 import OnednnInt8Weight, padded_rows

__all__ = ["ALPHA", "AVX2_ROWS", "CALIBRATION_TEXT", "SMALL_ROWS", "W8A8Weight", "available",
           "avx2_available", "small_available"]

ALPHA = 0.5  # SmoothQuant migration strength: 0.5 balances activation and weight ranges
CALIBRATION_TEXT = Path(__file__).resolve().parent / "data" / "calibration.txt"
CALIBRATION_TOKENS = 2048
SMALL_ROWS = 16  # few-row kernel cutoff until `calibrate.calibrate` measures it
# the AVX2 kernel takes every row count unless `calibrate.calibrate_small_rows` finds otherwise
AVX2_ROWS = 1 << 30
EXACT_FP32_K = (1 << 24) // (127 * 128)  # 1032: that many int8 x int8 products sum exactly in fp32


def available() -> bool:
    """The C++ quantize/dequantize passes built and torch has the int8 product."""
    return hasattr(torch, "_int_mm") and extension() is not None


@dataclass(slots=True)
class W8A8Weight:
    """A linear's weight for W8A8: int8 [in, out] of weight x smoothing factor, per output channel scales, and
    the inverse factors applied to the activations while they are quantized."""

    wt: torch.Tensor  # [in, out] int8
    col_scale: torch.Tensor  # [out] fp32
    inv_smooth: torch.Tensor  # [in] fp32
    # the same weight packed for a kernel of our own: "vnni" (few rows on AVX-512 VNNI, csrc/w8a8_small.cpp;
    # with the column sums) or "avx2" (any rows on AVX2 without int8 dot products, csrc/w8a8_avx2.cpp; no
    # sums)
    small: tuple[torch.Tensor, torch.Tensor | None] | None = None
    small_kind: str = ""
    small_rows: int = 0  # calls of up to this many rows take that kernel (`calibrate.calibrate_small_rows`)
    # the same weight prepacked for oneDNN (AMX where the CPU has it), set where
    # `calibrate.calibrate_int8_gemm` measured it faster than `_int_mm` on prefill-sized calls
    onednn: OnednnInt8Weight | None = None

    @classmethod
    def build(cls, weight: torch.Tensor, act_max: torch.Tensor | None, alpha: float = ALPHA,
              kernel: str | None = None) -> W8A8Weight:
        """`kernel`: "vnni", "avx2" or "none" (only `_int_mm`); None picks VNNI where built, else AVX2 where
        the CPU has no int8 dot products."""
        w = weight.detach().float()
        smooth = torch.ones(w.shape[1])
        if act_max is not None:
            smooth = act_max.float().clamp(min=1e-5) ** alpha / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha)
            smooth = smooth.clamp(min=1e-5)
        ws = w * smooth[None, :]
        scale = ws.abs().amax(1).clamp(min=1e-8) / 127
        wt = (ws / scale[:, None]).round().clamp(-127, 127).to(torch.int8).t().contiguous()
        lin = cls(wt, scale.contiguous(), (1.0 / smooth).contiguous())
        if kernel is None:
            kernel = ("vnni" if small_available()
                      else "avx2" if avx2_available() and not has_int8_dot() else "none")
        k, n = wt.shape
        if kernel == "vnni" and k % 4 == 0 and n % 16 == 0:
            lin.small, lin.small_kind, lin.small_rows = extension().w8a8_small_pack(wt), kernel, SMALL_ROWS
        elif kernel == "avx2" and k % 4 == 0 and n % 8 == 0:
            lin.small = (extension().w8a8_avx2_pack(wt), None)
            lin.small_kind, lin.small_rows = kernel, AVX2_ROWS
        return lin

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [rows, in] (bf16 or fp32, contiguous) -> [rows, out] of x2's dtype."""
        if not self.large_rows(x2.shape[0]):
            return self.forward_small(x2)
        return self.forward_int_mm(x2)

    def forward_int_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """The large-row path: quantize, the int8 product (oneDNN's where set, else `_int_mm`), dequantize."""
        xq, row_scale = self.quantize(x2)
        return extension().w8a8_dequantize(self.product(xq, x2.shape[0]), row_scale, self.col_scale, x2)

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x2's int8 codes (rows padded as `product` wants them) and per-row scales."""
        return extension().w8a8_quantize(x2, self.inv_smooth, self.pad_rows(x2.shape[0]))

    def pad_rows(self, rows: int) -> int:
        """The code rows `product` takes for `rows` rows (0: no padding)."""
        return padded_rows(rows) if self.onednn is not None else 0

    def product(self, xq: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows, out] int8 sums of codes `xq` (int32, or the same integers as fp32 from oneDNN)."""
        if self.onednn is not None:
            return self.onednn.matmul(xq)[:rows]
        return int8_matmul(xq, self.wt)

    def large_rows(self, rows: int) -> bool:
        """`rows` rows take the large-row path (`forward_int_mm`)."""
        return rows > self.small_rows

    def forward_small(self, x2: torch.Tensor) -> torch.Tensor:
        """Our kernel: bit-identical to `forward_int_mm`, without its per-call weight re-layout (and on AVX2
        without int8 dot products, without its fp32 GEMMs)."""
        packed, colsum = self.small
        if self.small_kind == "avx2":
            return extension().w8a8_avx2_linear(x2, self.inv_smooth, packed, self.col_scale)
        return extension().w8a8_small_linear(x2, self.inv_smooth, packed, colsum, self.col_scale)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.onednn is None else self.onednn.nbytes
        return self.wt.numel() + 4 * (self.col_scale.numel() + self.inv_smooth.numel()) + extra

    @property
    def small_nbytes(self) -> int:
        """Bytes of the few-row kernel's packed weight and column sums (0 without them)."""
        if self.small is None:
            return 0
        packed, colsum = self.small
        return packed.numel() + (0 if colsum is None else 4 * colsum.numel())


def int8_matmul(xq: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """[m, k] int8 @ [k, n] int8 -> [m, n] int32, exactly. `torch._int_mm` where the CPU has int8 dot
    products; elsewhere (AVX2 only, where `_int_mm` runs ~50x slower than an fp32 GEMM) fp32 GEMMs over slices
    of K short enough that every partial sum is an integer below 2^24, so exact in any order: the same
    bits."""
    return torch._int_mm(xq, wt) if has_int8_dot() else int8_matmul_fp32(xq, wt)


def int8_matmul_fp32(xq: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` on fp32 GEMMs (see there), on any CPU."""
    x, out = xq.float(), None
    for k0 in range(0, wt.shape[0], EXACT_FP32_K):
        part = (x[:, k0:k0 + EXACT_FP32_K] @ wt[k0:k0 + EXACT_FP32_K].float()).to(torch.int32)
        out = part if out is None else out.add_(part)
    return out


def small_available() -> bool:
    """The few-row W8A8 kernel was built (AVX-512 VNNI)."""
    ext = extension()
    return ext is not None and ext.w8a8_small_available()


def avx2_available() -> bool:
    """The AVX2 W8A8 kernel was built (every x86-64 CPU of the last decade)."""
    ext = extension()
    return ext is not None and ext.w8a8_avx2_available()


def calibration_ids(tokenizer) -> list[int]:
    return tokenizer.encode(CALIBRATION_TEXT.read_text())[:CALIBRATION_TOKENS]
