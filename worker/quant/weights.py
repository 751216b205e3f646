"""int8/int4 quantization of a loaded `LlamaModel` on CPU, with torch's packed matmul ops; fp8 (e4m3) on
Ada/Hopper GPUs with `torch._scaled_mm` (`worker.quant.fp8`, emulated elsewhere for tests and the quality
gate).

Small row counts (decode) run the weight-only kernels directly. Larger ones run through a copy of the
dequantized weight (bf16: prepacked once for oneDNN, `worker.quant.packed`), or, in `w8a8` mode, as int8 x
int8 products with SmoothQuant-smoothed per-row activation scales (`worker.quant.w8a8`). Cutoff and kernel
dtype are measured at load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.config import LAYER_LINEARS
from worker.quant import fp8
from worker.quant import w8a8 as smooth
from worker.quant.a16 import A16Weight
from worker.quant.calibrate import calibrate, restore_choices, save_choices
from worker.quant.calibration_cache import cached_maxima
from worker.quant.packed import PackedLinear, can_pack, pack, packed_linear

__all__ = ["CHOICES", "INT4_GROUP", "PACKED_MAX_ROWS", "QuantEmbedding", "QuantLinear", "quantize_model",
           "resolve_mode", "weight_bytes"]
log = logging.getLogger(__name__)

CHOICES = ("none", "int8", "int4", "w8a8", "fp8", "auto")
INT4_GROUP = 32  # int4 group size along the input dimension (576 = 18 x 32; 128 does not divide it)
PACKED_MAX_ROWS = 4  # default: above this many rows the int8/int4 kernels lose to the packed bf16 GEMM
_BLOCK_N = 64  # output rows per block in torch's CPU int4 packing (checked at runtime)


def resolve_mode(mode: str, device: torch.device) -> str:
    """The mode actually used. `auto` is `none` everywhere: every 8-bit mode passes the perplexity gate but
    changes the greedy answers users see (bench/greedy_agreement.py: on the default model each keeps under
    half the tokens transformers' bf16 keeps identical to fp32); w8a8, int8, int4 and fp8 are asked for."""
    if mode not in CHOICES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(CHOICES)}")
    if mode == "fp8":
        if not fp8.device_supported(device):
            raise ValueError("quantization 'fp8': fp8 needs a CUDA device of compute capability 8.9 or "
                             "newer "
                             f"(Ada, Hopper) and torch._scaled_mm (device {device}); choose 'none' or 'auto' "
                             "here")
        return mode
    if mode == "auto":
        return "none"
    if mode != "none" and (device.type != "cpu" or not _has_ops()):
        raise ValueError(f"quantization {mode!r} needs torch's packed CPU matmul ops on a CPU device "
                         f"(device {device}); choose 'none' or 'auto' here")
    if mode == "w8a8" and not smooth.available():
        raise ValueError("quantization 'w8a8' needs torch._int_mm and the C++ CPU kernels "
                         "(worker.kernels.cpu); "
                         "choose 'int8' here")
    return mode


def _has_ops() -> bool:
    return hasattr(torch, "_weight_int8pack_mm") and hasattr(torch, "_weight_int4pack_mm_for_cpu")


class QuantLinear(nn.Module):
    """A bias-free linear layer whose weight is int8 per output channel or int4 per group (asymmetric); `w8a8`
    is int8 with int8 activations above the decode cutoff (`act_max`: its input's calibrated channel
    maxima)."""

    def __init__(self, weight: torch.Tensor, mode: str, group: int = INT4_GROUP,
                 act_max: torch.Tensor | None = None) -> None:
        super().__init__()
        self.mode, self.group = mode, group
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        w = weight.detach().float()
        if mode in ("int8", "w8a8"):
            scale = w.abs().amax(1).clamp(min=1e-8) / 127
            self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
            self.register_buffer("scales", scale.to(self.dtype))
        elif mode == "int4":
            codes, sz = _quantize_int4(w, group, self.dtype)
            self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
            self.register_buffer("scales", sz)  # [in/group, out, 2]: scale and zero (value at code 8)
            # where this build's packing is not the one `_unpack_int4` reads (e.g. AVX2-only CPUs), keep the
            # codes one per byte, so large row counts can still dequantize instead of running the slow kernel
            self.codes = None if _int4_unpack_ok(self.out_features) else codes.to(torch.uint8)
        else:
            raise ValueError(f"QuantLinear mode must be int8, int4 or w8a8, got {mode!r}")
        self.max_rows = PACKED_MAX_ROWS  # set by `calibrate_max_rows` through `quantize_model`
        # large row counts: W8A8 products, or the dequantized weight (prepacked for oneDNN in bf16, else
        # plain)
        self.w8a8 = smooth.W8A8Weight.build(weight, act_max) if mode == "w8a8" else None
        self.packed = self.w8a8 is None and can_pack(self.dtype, weight.device)
        self.dense = (None if self.w8a8 is not None
                      else pack(self.dequantize()) if self.packed else self.dequantize())
        self.kernel_scales = self.scales  # the scales in the kernel's activation dtype (`use_kernel_dtype`)
        self.a16: A16Weight | None = None  # int16 activation rows, where `calibrate` measured them faster

    @property
    def kernel_dtype(self) -> torch.dtype:
        """Activation dtype of the int8/int4 kernel: the model's, or bf16 where fp32 activations are slow
        (torch's CPU kernels on AVX2-only CPUs are vectorized for bf16 activations only)."""
        return self.kernel_scales.dtype

    def use_kernel_dtype(self, dtype: torch.dtype) -> None:
        self.kernel_scales = self.scales if dtype == self.dtype else self.scales.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():  # the model's [tokens, features] rows: no reshapes
            return self.forward_quantized(x) if x.shape[0] <= self.max_rows else self.forward_dense(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = self.forward_quantized(x2) if x2.shape[0] <= self.max_rows else self.forward_dense(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def forward_dense(self, x2: torch.Tensor) -> torch.Tensor:
        """The large-row product (W8A8, or with the dequantized copy), whatever the row count."""
        if self.w8a8 is not None:
            return self.w8a8(x2.contiguous())
        return packed_linear(x2, self.dense) if self.packed else F.linear(x2, self.dense)

    def forward_quantized(self, x2: torch.Tensor) -> torch.Tensor:
        """The int8/int4 kernel itself, whatever the row count."""
        if self.a16 is not None:
            return self.a16(x2)
        xk = x2.to(self.kernel_dtype)
        if self.mode != "int4":
            y = torch._weight_int8pack_mm(xk, self.qweight, self.kernel_scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xk, self.qweight, self.group, self.kernel_scales)
        return y.to(x2.dtype)

    def logits(self, x2: torch.Tensor) -> torch.Tensor:
        """fp32 logits of an LM head's [rows, in] input: int16 rows on fp32 input give them unrounded at any
        row count (a bf16 output rounds near ties to one value: 3% of next tokens flipped on the default
        model); without that kernel, the chosen product widened."""
        if self.a16 is not None:
            return self.a16(x2.float())
        return self.forward(x2).float()

    def dequantize(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor of the model dtype (builds `dense`; a reference in
        tests)."""
        if self.mode != "int4":
            return self.qweight.to(self.dtype) * self.scales[:, None]
        codes = self.codes if self.codes is not None else _unpack_int4(self.qweight, self.out_features,
                                                                       self.in_features)
        q = codes.to(self.dtype)
        sz = self.scales.transpose(0, 1)  # [out, groups, 2]
        q = q.view(self.out_features, -1, self.group)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, mode={self.mode}, max_rows={self.max_rows}"



class QuantEmbedding(nn.Module):
    """Token embedding read from an int8 `QuantLinear` (the tied LM head): one copy of the table."""

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        if head.mode == "int4":
            raise ValueError("QuantEmbedding needs an int8 table")
        self.head = [head]  # a list, so the head's buffers are not registered twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.head[0]  # embedding gathers: ~10x faster than advanced indexing for prefill-sized ids
        return F.embedding(ids, h.qweight).to(h.dtype).mul_(F.embedding(ids, h.scales[:, None]))


def _quantize_int4(w: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group: codes [out, in] (int32, 0-15) and [in/group, out, 2] scale and zero."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 group {group} does not divide the input size {k}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype)
    return q, sz


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


def quantize_model(model: nn.Module, mode: str, *, group: int = INT4_GROUP, head: str = "int8",
                   calibration_ids: list[int] | None = None,
                   measure: Callable[[nn.Module, list[int]], dict] | None = None) -> None:
    """Swap the decoder's linear layers (and the LM head, as `head` says) for `QuantLinear`s in place.

    `w8a8` smooths with activation maxima that `measure(model, calibration_ids)` takes (the model floor's
    `worker.model.llama.activation_maxima`; no ids: unsmoothed).
    `fp8` swaps them for `fp8.Fp8Linear`s instead (any device: off Ada/Hopper GPUs they run an emulation)."""
    if mode == "none":
        return
    if mode == "fp8":
        _quantize_fp8(model)
        return
    maxima: dict = {}
    if mode == "w8a8" and calibration_ids:
        if measure is None:
            raise ValueError("w8a8 calibration ids need `measure` (worker.model.llama.activation_maxima)")
        maxima = cached_maxima(model, calibration_ids, lambda: measure(model, calibration_ids))
    restore_choices()
    with torch.inference_mode(False), torch.no_grad():
        for i, layer in enumerate(model.layers):
            for name in LAYER_LINEARS:
                lin = QuantLinear(getattr(layer, name).weight, mode, group, maxima.get((i, name)))
                setattr(layer, name, lin)
        if head != "none":
            # a prepacked head (worker.quant.packed) no longer shares the embedding's tensor: ask the config
            tied = model.lm_head.weight is model.embed.weight or (
                isinstance(model.lm_head, PackedLinear) and model.cfg.tie_word_embeddings)
            model.lm_head = QuantLinear(model.lm_head.weight, head, group)
            if tied and head != "int4":
                model.embed = QuantEmbedding(model.lm_head)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                calibrate(m)
        lm_head = model.lm_head
        if (isinstance(lm_head, QuantLinear) and lm_head.mode == "int8" and lm_head.a16 is None
                and lm_head.qweight.device.type == "cpu"):
            lm_head.a16 = A16Weight.build(lm_head.qweight, lm_head.scales)  # its fp32 logits (`logits`)
    save_choices()
    first, lm_head = model.layers[0].gate_up, model.lm_head
    above = ("int8 x int8 products (SmoothQuant, per-row activation scales)" if first.w8a8 is not None
             else "dequantized prepacked bf16 weights" if first.packed else "dequantized dense weights")
    log.info("quantized linear layers to %s (LM head: %s); weight-only kernel (%s activations) up to %d rows "
             "(LM head: %s, %s activations), %s above", mode, head, _activations(first), first.max_rows,
             getattr(lm_head, "max_rows", "-"), _activations(lm_head), above)
    if first.w8a8 is not None and first.w8a8.small is not None:
        kind = "AVX2 vpmaddubsw / vpmaddwd" if first.w8a8.small_kind == "avx2" else "AVX-512 VNNI"
        log.info("W8A8 few-row kernel (%s, prepacked) up to %d rows, %s above", kind, first.w8a8.small_rows,
                 "oneDNN's int8 product" if first.w8a8.onednn is not None else "torch._int_mm")


def _activations(lin: nn.Module) -> str:
    if not isinstance(lin, QuantLinear):
        return "-"
    if lin.a16 is not None:
        return "int16 rows (" + ("AVX-512 VNNI" if lin.a16.kind == "vnni" else "AVX2") + ")"
    return str(lin.kernel_dtype).removeprefix("torch.")


def _quantize_fp8(model: nn.Module) -> None:
    # the embedding and the LM head stay in the model dtype: the table is gathered by row (no product to
    # speed up) and the head (tied to it in the default model) decides the logits themselves
    with torch.inference_mode(False), torch.no_grad():
        for layer in model.layers:
            for name in LAYER_LINEARS:
                setattr(layer, name, fp8.Fp8Linear(getattr(layer, name).weight))
    dev = model.embed.weight.device
    log.info("quantized linear layers to fp8 (e4m3, per-channel weight and per-token activation scales; %s); "
             "embedding and LM head unquantized", "torch._scaled_mm" if fp8.device_supported(dev)
             else "emulated")


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads: every parameter and buffer except the embedding table (gathered by row).
    `Fp8Linear`s hold only buffers: 1 byte per weight plus 4 per output channel (scales)."""
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
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, PackedLinear))
    few_row = sum(m.w8a8.small_nbytes for m in model.modules()  # W8A8 decodes read the packed copy
                  if isinstance(m, QuantLinear) and m.qweight is None)
    return total + packed + few_row
