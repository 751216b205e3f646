"""Weight-only int8/int4 quantization of a loaded `LlamaModel` on CPU, with torch's packed matmul ops.

Small row counts (decode) run the packed kernels directly; large ones (prefill) are faster through a
transient bf16 copy of one matrix at a time (measured: docs in README "Quantization").
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CHOICES", "INT4_GROUP", "PACKED_MAX_ROWS", "QuantEmbedding", "QuantLinear", "quantize_model",
           "resolve_mode", "weight_bytes"]
log = logging.getLogger(__name__)

CHOICES = ("none", "int8", "int4", "auto")
INT4_GROUP = 32  # int4 group size along the input dimension (576 = 18 x 32; 128 does not divide it)
PACKED_MAX_ROWS = 24  # above this many rows the packed CPU kernels lose to dequantize + bf16 GEMM
_BLOCK_N = 64  # output rows per block in torch's CPU int4 packing (checked at runtime)


def resolve_mode(mode: str, device: torch.device) -> str:
    """The mode actually used; `auto` is int8 on CPU (fastest passing the gate here), none elsewhere."""
    if mode not in CHOICES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(CHOICES)}")
    if mode == "auto":
        return "int8" if device.type == "cpu" and _has_ops() else "none"
    if mode != "none" and (device.type != "cpu" or not _has_ops()):
        raise ValueError(f"quantization {mode!r} needs torch's packed CPU matmul ops on a CPU device "
                         f"(device {device}); choose 'none' or 'auto' here")
    return mode


def _has_ops() -> bool:
    return hasattr(torch, "_weight_int8pack_mm") and hasattr(torch, "_weight_int4pack_mm_for_cpu")


class QuantLinear(nn.Module):
    """A bias-free linear layer whose weight is int8 per output channel or int4 per group (asymmetric)."""

    def __init__(self, weight: torch.Tensor, mode: str, group: int = INT4_GROUP) -> None:
        super().__init__()
        self.mode, self.group = mode, group
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        w = weight.detach().float()
        if mode == "int8":
            scale = w.abs().amax(1).clamp(min=1e-8) / 127
            self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
            self.register_buffer("scales", scale.to(self.dtype))
        elif mode == "int4":
            packed, sz = _pack_int4(w, group, self.dtype)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", sz)  # [in/group, out, 2]: scale and zero (value at code 8)
        else:
            raise ValueError(f"QuantLinear mode must be int8 or int4, got {mode!r}")
        self.unpackable = mode == "int8" or _int4_unpack_ok(self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] > PACKED_MAX_ROWS and self.unpackable:
            y = F.linear(x2, self.dequantize())
        elif self.mode == "int8":
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales)
        return y.reshape(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor of the model dtype (used transiently for large row counts)."""
        if self.mode == "int8":
            return self.qweight.to(self.dtype) * self.scales[:, None]
        q = _unpack_int4(self.qweight, self.out_features, self.in_features).to(self.dtype)
        sz = self.scales.transpose(0, 1)  # [out, groups, 2]
        q = q.view(self.out_features, -1, self.group)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, mode={self.mode}"


class QuantEmbedding(nn.Module):
    """Token embedding read from an int8 `QuantLinear` (the tied LM head): one copy of the table."""

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        if head.mode != "int8":
            raise ValueError("QuantEmbedding needs an int8 table")
        self.head = [head]  # a list, so the head's buffers are not registered twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.head[0]
        return h.qweight[ids].to(h.dtype) * h.scales[ids, None]


def _pack_int4(w: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 group {group} does not divide the input size {k}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype)
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), sz


def _unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of torch's CPU int4 packing: per 64 output rows, byte (k, j) = w[j, k] | w[j + 32, k] << 4."""
    p = packed.view(n // _BLOCK_N, k, _BLOCK_N // 2)
    q = torch.cat([p & 15, p >> 4], dim=2)  # [blocks, k, 64]
    return q.transpose(1, 2).reshape(n, k)


_UNPACK_OK: dict[int, bool] = {}


def _int4_unpack_ok(n: int) -> bool:
    """Whether `_unpack_int4` matches this build's packing for `n` output rows (else packed kernel only)."""
    if n % _BLOCK_N:
        return False
    if n not in _UNPACK_OK:
        q = torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        _UNPACK_OK[n] = packed.shape == (n, 32) and torch.equal(_unpack_int4(packed, n, 64).int(), q)
    return _UNPACK_OK[n]


def quantize_model(model: nn.Module, mode: str, *, group: int = INT4_GROUP, head: str = "int8") -> None:
    """Swap the decoder's linear layers (and the LM head, as `head` says) for `QuantLinear`s in place."""
    if mode == "none":
        return
    with torch.inference_mode(False), torch.no_grad():
        for layer in model.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, QuantLinear(getattr(layer, name).weight, mode, group))
        if head != "none":
            tied = model.lm_head.weight is model.embed.weight
            model.lm_head = QuantLinear(model.lm_head.weight, head, group)
            if tied and head == "int8":
                model.embed = QuantEmbedding(model.lm_head)
    log.info("quantized linear layers to %s (LM head: %s)", mode, head)


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads: every parameter and buffer except the embedding table (gathered by row)."""
    seen: set[int] = set()
    total = 0
    embed = getattr(model, "embed", None)
    skip = {id(t) for t in embed.parameters()} if isinstance(embed, nn.Embedding) else set()
    tied = isinstance(embed, nn.Embedding) and model.lm_head.weight is embed.weight
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or (id(t) in skip and not tied):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
