"""int8/int4 quantization of a loaded `LlamaModel` on CPU, with torch's packed matmul ops; fp8 (e4m3) on
Ada/Hopper GPUs with `torch._scaled_mm` (`worker.quant.fp8`, emulated elsewhere for tests and the quality gate).

Small row counts (decode) run the weight-only kernels directly. Larger ones run through a copy of the
dequantized weight (bf16: prepacked once for oneDNN, `worker.quant.packed`), or, in `w8a8` mode, as int8 x int8
products with SmoothQuant-smoothed per-row activation scales (`worker.quant.w8a8`). Cutoff and kernel dtype are
measured at load.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels.cpu_features import has_amx_int8, has_int8_dot
from worker.quant import fp8, onednn_int8
from worker.quant import w8a8 as smooth
from worker.quant.calibration_cache import cached_maxima
from worker.quant.packed import PackedLinear, can_pack, pack, packed_linear

__all__ = ["CHOICES", "INT4_GROUP", "PACKED_MAX_ROWS", "QuantEmbedding", "QuantLinear", "quantize_model",
           "calibrate", "calibrate_max_rows", "calibrate_small_rows", "resolve_mode", "weight_bytes"]
log = logging.getLogger(__name__)

CHOICES = ("none", "int8", "int4", "w8a8", "fp8", "auto")
INT4_GROUP = 32  # int4 group size along the input dimension (576 = 18 x 32; 128 does not divide it)
PACKED_MAX_ROWS = 4  # default: above this many rows the int8/int4 kernels lose to the packed bf16 GEMM
MAX_ROWS_ENV = "SWITCHYARD_QUANT_MAX_ROWS"  # an integer fixes the cutoff; unset: calibrated at load
PROBE_LOSS = 4.0  # a candidate this many times slower at the first size is not timed further
INT8_GEMM_ENV = "SWITCHYARD_INT8_GEMM"  # "onednn" or "int_mm" fixes W8A8's large-row product; unset: measured
KEEP_KERNEL_MARGIN = 0.9  # `_int_mm` takes a row count from our W8A8 kernel only when 10% faster there
_BLOCK_N = 64  # output rows per block in torch's CPU int4 packing (checked at runtime)


def resolve_mode(mode: str, device: torch.device) -> str:
    """The mode actually used. `auto` is the fastest mode passing the quality gate, served end to end (README,
    Quantization): on CPU w8a8 where it has int8 dot-product instructions (VNNI, AMX) and the C++ kernels
    built, int8 otherwise; none elsewhere (fp8 is chosen explicitly, on CUDA devices of capability 8.9+)."""
    if mode not in CHOICES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(CHOICES)}")
    if mode == "fp8":
        if not fp8.device_supported(device):
            raise ValueError(f"quantization 'fp8': fp8 needs a CUDA device of compute capability 8.9 or newer "
                             f"(Ada, Hopper) and torch._scaled_mm (device {device}); choose 'none' or 'auto' here")
        return mode
    if mode == "auto":
        if device.type != "cpu" or not _has_ops():
            return "none"
        # w8a8 on int8 dot products (VNNI, AMX), and on AVX2 through csrc/w8a8_avx2.cpp, which beat the int8 mode's
        # weight-only kernel and its fp32 copy at every row count (docs/cpu-performance.md)
        fast = has_int8_dot() or smooth.avx2_available()
        return "w8a8" if fast and smooth.available() else "int8"
    if mode != "none" and (device.type != "cpu" or not _has_ops()):
        raise ValueError(f"quantization {mode!r} needs torch's packed CPU matmul ops on a CPU device "
                         f"(device {device}); choose 'none' or 'auto' here")
    if mode == "w8a8" and not smooth.available():
        raise ValueError("quantization 'w8a8' needs torch._int_mm and the C++ CPU kernels (worker.kernels.cpu); "
                         "choose 'int8' here")
    return mode


def _has_ops() -> bool:
    return hasattr(torch, "_weight_int8pack_mm") and hasattr(torch, "_weight_int4pack_mm_for_cpu")


class QuantLinear(nn.Module):
    """A bias-free linear layer whose weight is int8 per output channel or int4 per group (asymmetric); `w8a8`
    is int8 with int8 activations above the decode cutoff (`act_max`: its input's calibrated channel maxima)."""

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
        # large row counts: W8A8 products, or the dequantized weight (prepacked for oneDNN in bf16, else plain)
        self.w8a8 = smooth.W8A8Weight.build(weight, act_max) if mode == "w8a8" else None
        self.packed = self.w8a8 is None and can_pack(self.dtype, weight.device)
        self.dense = None if self.w8a8 is not None else pack(self.dequantize()) if self.packed else self.dequantize()
        self.kernel_scales = self.scales  # the scales in the kernel's activation dtype (`use_kernel_dtype`)

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
        xk = x2.to(self.kernel_dtype)
        if self.mode != "int4":
            y = torch._weight_int8pack_mm(xk, self.qweight, self.kernel_scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xk, self.qweight, self.group, self.kernel_scales)
        return y.to(x2.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor of the model dtype (builds `dense`; a reference in tests)."""
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
                   calibration_ids: list[int] | None = None) -> None:
    """Swap the decoder's linear layers (and the LM head, as `head` says) for `QuantLinear`s in place.

    `w8a8` smooths with activation maxima measured on `calibration_ids` (`worker.quant.w8a8`; none: unsmoothed).
    `fp8` swaps them for `fp8.Fp8Linear`s instead (any device: off Ada/Hopper GPUs they run an emulation)."""
    if mode == "none":
        return
    if mode == "fp8":
        _quantize_fp8(model)
        return
    maxima: dict = {}
    if mode == "w8a8" and calibration_ids:
        maxima = cached_maxima(model, calibration_ids, lambda: smooth.activation_maxima(model, calibration_ids))
    with torch.inference_mode(False), torch.no_grad():
        for i, layer in enumerate(model.layers):
            for name in ("qkv", "o", "gate_up", "down"):
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
    first, lm_head = model.layers[0].gate_up, model.lm_head
    above = ("int8 x int8 products (SmoothQuant, per-row activation scales)" if first.w8a8 is not None
             else "dequantized prepacked bf16 weights" if first.packed else "dequantized dense weights")
    log.info("quantized linear layers to %s (LM head: %s); weight-only kernel (%s activations) up to %d rows "
             "(LM head: %s), %s above", mode, head, str(first.kernel_dtype).removeprefix("torch."),
             first.max_rows, getattr(lm_head, "max_rows", "-"), above)
    if first.w8a8 is not None and first.w8a8.small is not None:
        kind = "AVX2 vpmaddubsw / vpmaddwd" if first.w8a8.small_kind == "avx2" else "AVX-512 VNNI"
        log.info("W8A8 few-row kernel (%s, prepacked) up to %d rows, %s above", kind, first.w8a8.small_rows,
                 "oneDNN's int8 product" if first.w8a8.onednn is not None else "torch._int_mm")


def _quantize_fp8(model: nn.Module) -> None:
    # the embedding and the LM head stay in the model dtype: the table is gathered by row (no product to
    # speed up) and the head (tied to it in the default model) decides the logits themselves
    with torch.inference_mode(False), torch.no_grad():
        for layer in model.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, fp8.Fp8Linear(getattr(layer, name).weight))
    dev = model.embed.weight.device
    log.info("quantized linear layers to fp8 (e4m3, per-channel weight and per-token activation scales; %s); "
             "embedding and LM head unquantized", "torch._scaled_mm" if fp8.device_supported(dev) else "emulated")


def calibrate(lin: QuantLinear) -> None:
    """Set `lin`'s kernel activation dtype (fp32 models: the faster at one row, once per weight shape in a
    process) and its row cutoff (`calibrate_max_rows`, measured with that dtype)."""
    if lin.dtype == torch.float32:
        key = (lin.mode, lin.out_features, lin.in_features)
        if key not in _KERNEL_DTYPES:
            x = torch.randn(1, lin.in_features)
            times = {}
            for dtype in (torch.float32, torch.bfloat16):
                lin.use_kernel_dtype(dtype)
                times[dtype] = _best_time(lambda: lin.forward_quantized(x))
            _KERNEL_DTYPES[key] = min(times, key=times.get)
        lin.use_kernel_dtype(_KERNEL_DTYPES[key])
    if lin.w8a8 is not None:
        calibrate_int8_gemm(lin.w8a8, lin.dtype)
    if lin.w8a8 is not None and lin.w8a8.small is not None and not os.environ.get(MAX_ROWS_ENV):
        # the few-row W8A8 kernel beats the weight-only one at every row count: W8A8 throughout, and the
        # weight-only int8 copy is not kept (one int8 copy fewer: ~107 MB for the default model)
        lin.max_rows = 0
        lin.w8a8.small_rows = calibrate_small_rows(lin.w8a8, lin.dtype)
        lin.qweight = None
    else:
        lin.max_rows = calibrate_max_rows(lin)


def calibrate_max_rows(lin: QuantLinear, candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)) -> int:
    """The largest row count up to which `lin`'s int8/int4 kernel beats its dequantized copy (best of 5 runs).

    `SWITCHYARD_QUANT_MAX_ROWS` fixes it instead. About 50 ms on the default model; the kernel's cost
    relative to bf16 depends on the CPU (the int8 one loses from ~8 rows on AMD Zen 4 without AMX)."""
    env = os.environ.get(MAX_ROWS_ENV)
    if env:
        return max(0, int(env))
    key = (lin.mode, lin.out_features, lin.in_features, lin.dtype, lin.kernel_dtype, candidates)
    if key not in _CALIBRATED:  # once per process: two models loaded here choose the same kernels
        _CALIBRATED[key] = _measure_max_rows(lin, candidates)
    return _CALIBRATED[key]


def calibrate_small_rows(w: smooth.W8A8Weight, dtype: torch.dtype,
                         candidates: tuple[int, ...] = (1, 4, 8, 16, 24, 32, 48, 64)) -> int:
    """The largest row count up to which our W8A8 kernel is within 10% of `_int_mm` (best of 5, in turns; once per
    weight shape in a process). Where both read the weight from memory the few-row kernel wins at decode sizes; `_int_mm` catches
    up once the products are compute-bound (16-32 rows on AMD Zen 4). The AVX2 kernel is measured up to 1,024
    rows, and keeps every row count if it wins there (without int8 dot products `_int_mm` is fp32 GEMMs)."""
    if w.small is None:
        return 0
    if w.small_kind == "avx2":
        candidates = (1, 64, 1024)
    key = ("small", w.small_kind, *w.wt.shape, dtype, candidates)
    if key not in _CALIBRATED:
        best = 0
        with torch.inference_mode():
            for rows in candidates:
                x = torch.randn(rows, w.wt.shape[0], dtype=dtype)
                t_kernel, t_int_mm = _interleaved_best([lambda x=x: w.forward_small(x), lambda x=x: w.forward_int_mm(x)])
                if t_int_mm < KEEP_KERNEL_MARGIN * t_kernel:
                    break
                best = rows
        if w.small_kind == "avx2" and best == candidates[-1]:  # won at every size: every row count
            best = smooth.AVX2_ROWS
        _CALIBRATED[key] = best
    return _CALIBRATED[key]


def calibrate_int8_gemm(w: smooth.W8A8Weight, dtype: torch.dtype, rows: tuple[int, ...] = (64, 512)) -> None:
    """Prepack `w` for oneDNN's int8 product where it beats `_int_mm` by 5% over prefill-sized calls (best of 5;
    once per weight shape in a process). Considered only on CPUs with AMX int8 tiles, where oneDNN ran 1.4-2.8x
    `_int_mm`'s VNNI rate (Intel Xeon 4th gen on): elsewhere `_int_mm` already is oneDNN's VNNI GEMM, and the
    quantized linear's calls fell to oneDNN's reference loops on AMD Zen 4 (`ref_int8`, ~1,000x slower: measuring
    it cost 134 s of every start). `SWITCHYARD_INT8_GEMM` (onednn|int_mm) fixes the choice."""
    env = os.environ.get(INT8_GEMM_ENV) or None
    if env not in (None, "onednn", "int_mm"):
        raise ValueError(f"{INT8_GEMM_ENV}={env!r}: use onednn or int_mm, or leave it unset (measured)")
    if not (has_int8_dot() and onednn_int8.available()) or env == "int_mm" or (env is None and not has_amx_int8()):
        return
    key = ("onednn", *w.wt.shape, dtype, rows)
    packed = onednn_int8.OnednnInt8Weight.pack(w.wt) if env == "onednn" or _CALIBRATED.get(key, 1) else None
    if env != "onednn" and key not in _CALIBRATED:
        _CALIBRATED[key] = int(_onednn_wins(w, packed, dtype, rows))
    w.onednn = packed if env == "onednn" or _CALIBRATED[key] else None


def _onednn_wins(w: smooth.W8A8Weight, packed: onednn_int8.OnednnInt8Weight, dtype: torch.dtype,
                 rows: tuple[int, ...]) -> bool:
    """oneDNN's product beats `_int_mm` by 5% summed over `rows`; a loss by PROBE_LOSS at the first row count ends
    the measurement there (a reference kernel would otherwise take seconds a call at 512 rows)."""
    times = [0.0, 0.0]
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, w.wt.shape[0], dtype=dtype)
            for i, choice in enumerate((None, packed)):
                w.onednn = choice
                times[i] += _best_time(lambda x=x: w.forward_int_mm(x))
            if times[1] > PROBE_LOSS * times[0]:
                return False
    return times[1] < 0.95 * times[0]


_KERNEL_DTYPES: dict[tuple, torch.dtype] = {}  # per process: the kernel's activation dtype by mode and shape
_CALIBRATED: dict[tuple, int] = {}  # per process: row cutoffs by mode (or "small"), shape and dtypes


def _measure_max_rows(lin: QuantLinear, candidates: tuple[int, ...]) -> int:
    best = 0
    with torch.inference_mode():
        for rows in candidates:
            x = torch.randn(rows, lin.in_features, dtype=lin.dtype)
            t_q = _best_time(lambda x=x: lin.forward_quantized(x))
            t_d = _best_time(lambda x=x: lin.forward_dense(x))
            if t_q > t_d:
                break
            best = rows
    return best


def _interleaved_best(fns: list, runs: int = 5) -> list[float]:
    """Best time of each of `fns`, run in turns after a warm-up (a slow spell of a shared host hits them alike; timed
    one after the other, the AVX2 kernel's 1,024-row check flipped between starts on a noisy AMD Zen 3 VM)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(runs):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _best_time(fn, runs: int = 5) -> float:
    return _interleaved_best([fn], runs)[0]


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
