"""fp8 (e4m3) linear layers: per-output-channel weight scales, dynamic per-row activation scales.

CUDA devices of compute capability 8.9+ (Ada, Hopper) multiply with `torch._scaled_mm`; elsewhere an fp32
emulation of the very same quantization runs (the CPU reference of the device path, in tests).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Linear", "dequantize_fp8", "device_supported", "quantize_fp8",
           "quantize_rows_fp8"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale (its codes are all zero)
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9) and Hopper (9.0) onwards


def _quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric e4m3 codes of a 2-D tensor and its fp32 scale per row (max |row| / 448), both on its
    device."""
    amax = t.abs().amax(dim=1, keepdim=True).float()  # exact in t's dtype; no fp32 copy of t
    # 448 as a tensor on the device: CUDA divides by a Python number as a product with its rounded reciprocal,
    # the CPU exactly; true division on both keeps their codes identical (and q * scale requantizes exactly)
    scale = (amax / amax.new_full((), FP8_MAX)).clamp(min=MIN_SCALE)
    # amax / scale can round a hair above 448, and e4m3fn has no infinity (it would become NaN): clamp first
    q = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # t / scale: fp32 (type promotion)
    return q, scale


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as e4m3 codes [out, in] and fp32 per-output-channel scales [out]."""
    q, scale = _quantize_rows(w)
    return q, scale[:, 0]


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] as e4m3 codes [M, K] and fp32 per-row (per-token) scales [M, 1]."""
    return _quantize_rows(x)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of codes [rows, cols] with per-row scales ([rows] or [rows, 1])."""
    return q.float() * scale.reshape(-1, 1)


@functools.cache
def _device_row_quantizer() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`quantize_rows_fp8` as one Triton kernel where triton is installed (the same codes), else in torch;
    looked up once, not on every call of a layer."""
    if importlib.util.find_spec("triton") is None:
        return quantize_rows_fp8
    from worker.kernels.triton_ops import quantize_rows_fp8 as fused

    return functools.partial(fused, fp8_max=FP8_MAX, min_scale=MIN_SCALE)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_supported(device: torch.device) -> bool:
    """`torch._scaled_mm` with fp8 operands runs on `device`: CUDA, compute capability 8.9 or newer."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= MIN_CAPABILITY


class Fp8Linear(nn.Module):
    """A bias-free linear layer with an e4m3 weight [out, in] and fp32 per-output-channel scales (`wscale`);
    each call quantizes its input rows dynamically. Returns the input's dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype  # the original weight's dtype (the model's)
        q, scale = quantize_fp8(weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("wscale", scale)
        # torch._scaled_mm takes K and N multiples of 16 (any M: 1 and 7 rows checked on an H200, torch 2.11)
        self.mm_shape_ok = self.in_features % 16 == 0 and self.out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda and self.mm_shape_ok and device_supported(x2.device):
            xq, sx = _device_row_quantizer()(x2)
            y = self._scaled_mm(xq, sx, x2.dtype)
        else:
            xq, sx = quantize_rows_fp8(x2)
            y = self._emulate(xq, sx, x2.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _scaled_mm(self, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """fp8 tensor cores: fp32 accumulation, then both scales; bf16 out (older torch releases take no other
        with row-wise scales; torch 2.11 also takes fp32), cast back for fp32/fp16 inputs."""
        y = torch._scaled_mm(xq, self.qweight.t(), scale_a=sx, scale_b=self.wscale.view(1, -1),
                             out_dtype=torch.bfloat16)
        return y if dtype == torch.bfloat16 else y.to(dtype)

    def _emulate(self, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The device's arithmetic in fp32: code products (exact in fp32) summed, then scaled by both
        scales."""
        y = (xq.float() @ self.qweight.float().t()) * (sx * self.wscale)
        return y.to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight the layer multiplies by: fp32 [out, in] (a reference in tests)."""
        return dequantize_fp8(self.qweight, self.wscale)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, fp8=e4m3, "
                f"dtype={str(self.dtype).removeprefix('torch.')}")
