"""Kernel choices measured at load: each quantized linear's activation dtype and row cutoffs, and W8A8's
large-row product, timed once per weight shape and kept on disk per CPU, torch, kernel build and thread count
(`calibration_cache.load_choices`), so that a restarted worker times nothing and chooses as before.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from worker.kernels.cpu_features import has_amx_int8, has_int8_dot
from worker.quant import onednn_int8
from worker.quant import w8a8 as smooth
from worker.quant.a16 import A16Weight
from worker.quant.calibration_cache import load_choices, store_choices

__all__ = ["INT8_GEMM_ENV", "KEEP_KERNEL_MARGIN", "MAX_ROWS_ENV", "PROBE_LOSS", "calibrate", "calibrate_a16",
           "calibrate_int8_gemm", "calibrate_max_rows", "calibrate_small_rows", "restore_choices",
           "save_choices"]

MAX_ROWS_ENV = "SWITCHYARD_QUANT_MAX_ROWS"  # an integer fixes the cutoff; unset: calibrated at load
PROBE_LOSS = 4.0  # a candidate this many times slower at the first size is not timed further
INT8_GEMM_ENV = "SWITCHYARD_INT8_GEMM"  # "onednn" or "int_mm" fixes W8A8's large-row product; unset: measured
KEEP_KERNEL_MARGIN = 0.9  # `_int_mm` takes a row count from our W8A8 kernel only when 10% faster there
_DTYPES = (torch.float32, torch.bfloat16)  # the kernel activation dtypes, stored by index

# per process, and on disk between processes: row cutoffs, dtype indexes and oneDNN verdicts by a key naming
# the choice, the shape and the dtypes; `_measured` says whether this process added any
_CALIBRATED: dict[str, int] = {}
_measured = False


def _key(*parts: object) -> str:
    return "|".join(map(str, parts))


def _remember(key: str, value: int) -> None:
    global _measured
    _CALIBRATED[key], _measured = value, True


def restore_choices() -> None:
    """Take this machine's stored choices for the keys this process has not measured (before a model
    loads)."""
    for key, value in load_choices().items():
        _CALIBRATED.setdefault(key, value)


def save_choices() -> None:
    """Store the choices where this process measured new ones (after a model loaded)."""
    global _measured
    if _measured:
        store_choices(dict(_CALIBRATED))
        _measured = False


def calibrate(lin: nn.Module) -> None:
    """Set `lin`'s kernel activation dtype (fp32 models: the faster at one row, once per weight shape) and its
    row cutoffs (`calibrate_small_rows` for W8A8's few-row kernel, else `calibrate_max_rows`). `lin` is a
    `weights.QuantLinear`, not imported here: weights.py imports this module."""
    if lin.dtype == torch.float32:
        key = _key("dtype", lin.mode, lin.out_features, lin.in_features)
        if key not in _CALIBRATED:
            x = torch.randn(1, lin.in_features)
            times = []
            for dtype in _DTYPES:
                lin.use_kernel_dtype(dtype)
                times.append(_best_time(lambda: lin.forward_quantized(x)))
            _remember(key, times.index(min(times)))
        lin.use_kernel_dtype(_DTYPES[_CALIBRATED[key]])
    if lin.mode == "int8":
        calibrate_a16(lin)
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


def calibrate_a16(lin: nn.Module, rows: tuple[int, ...] = (1, 16)) -> None:
    """Give an int8 weight-only `lin` int16 activation rows (`worker.quant.a16`: VNNI, else AVX2) where that
    beats torch's int8 kernel over `rows` (best of 5, in turns; once per weight shape and kernel): 3-4x on the
    LM head on AMD Zen 3."""
    kind = A16Weight.pick(lin.qweight)
    if kind is None:
        return
    key = _key("a16", kind, lin.out_features, lin.in_features, lin.dtype, lin.kernel_dtype, rows)
    if _CALIBRATED.get(key) == 0:  # measured slower before: nothing to pack
        return
    a16 = A16Weight.build(lin.qweight, lin.scales, kind)
    if key not in _CALIBRATED:
        times = [0.0, 0.0]
        with torch.inference_mode():
            for n in rows:
                x = torch.randn(n, lin.in_features, dtype=lin.dtype)
                pair = _interleaved_best([lambda x=x: lin.forward_quantized(x), lambda x=x: a16(x)])
                times = [t + p for t, p in zip(times, pair, strict=True)]
        _remember(key, int(times[1] < times[0]))
    lin.a16 = a16 if _CALIBRATED[key] else None


def calibrate_max_rows(lin: nn.Module, candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)) -> int:
    """The largest row count up to which `lin`'s int8/int4 kernel beats its dequantized copy (best of 5 runs).

    `SWITCHYARD_QUANT_MAX_ROWS` fixes it instead. About 50 ms on the default model; the kernel's cost
    relative to bf16 depends on the CPU (the int8 one loses from ~8 rows on AMD Zen 4 without AMX)."""
    env = os.environ.get(MAX_ROWS_ENV)
    if env:
        return max(0, int(env))
    if lin.a16 is not None:  # int16 rows: ~2.5x the dense fp32 GEMM at 64 rows on AMD Zen 3
        candidates = (*candidates, 64)
    kernel = f"a16-{lin.a16.kind}" if lin.a16 is not None else lin.kernel_dtype
    key = _key("max_rows", lin.mode, lin.out_features, lin.in_features, lin.dtype, kernel, candidates)
    if key not in _CALIBRATED:  # once: two models loaded here choose the same kernels
        _remember(key, _measure_max_rows(lin, candidates))
    return _CALIBRATED[key]


def calibrate_small_rows(w: smooth.W8A8Weight, dtype: torch.dtype,
                         candidates: tuple[int, ...] = (1, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)) -> int:
    """The largest row count up to which our W8A8 kernel is within 10% of `_int_mm` (best of 5, in turns; once
    per weight shape; the first loss ends the scan). Where both read the weight from memory the few-row kernel
    wins at decode sizes; with its 8-row tile it also kept up with `_int_mm` (oneDNN's VNNI GEMM) at prefill
    sizes on AMD Zen 4 (a 512-token prefill 428 -> 411 ms taking it at every size), while oneDNN's AMX
    product, where `calibrate_int8_gemm` chose it, wins from a few dozen rows. The AVX2 kernel is measured up
    to 1,024 rows, and keeps every row count if it wins there (without int8 dot products `_int_mm` is fp32
    GEMMs)."""
    if w.small is None:
        return 0
    if w.small_kind == "avx2":
        candidates = (1, 64, 1024)
    key = _key("small", w.small_kind, *w.wt.shape, dtype, candidates)
    if key not in _CALIBRATED:
        best = 0
        with torch.inference_mode():
            for rows in candidates:
                x = torch.randn(rows, w.wt.shape[0], dtype=dtype)
                t_kernel, t_int_mm = _interleaved_best([lambda x=x: w.forward_small(x),
                                                        lambda x=x: w.forward_int_mm(x)])
                if t_int_mm < KEEP_KERNEL_MARGIN * t_kernel:
                    break
                best = rows
        if w.small_kind == "avx2" and best == candidates[-1]:  # won at every size: every row count
            best = smooth.AVX2_ROWS
        _remember(key, best)
    return _CALIBRATED[key]


def calibrate_int8_gemm(w: smooth.W8A8Weight, dtype: torch.dtype, rows: tuple[int, ...] = (64, 512)) -> None:
    """Prepack `w` for oneDNN's int8 product where it beats `_int_mm` by 5% over prefill-sized calls (best of
    5; once per weight shape). Considered only on CPUs with AMX int8 tiles, where oneDNN ran 1.4-2.8x
    `_int_mm`'s VNNI rate (Intel Xeon 4th gen on): elsewhere `_int_mm` already is oneDNN's VNNI GEMM, and the
    quantized linear's calls fell to oneDNN's reference loops on AMD Zen 4 (`ref_int8`, ~1,000x slower:
    measuring it cost 134 s of every start). `SWITCHYARD_INT8_GEMM` (onednn|int_mm) fixes the choice."""
    env = os.environ.get(INT8_GEMM_ENV) or None
    if env not in (None, "onednn", "int_mm"):
        raise ValueError(f"{INT8_GEMM_ENV}={env!r}: use onednn or int_mm, or leave it unset (measured)")
    if (not (has_int8_dot() and onednn_int8.available()) or env == "int_mm"
            or (env is None and not has_amx_int8())):
        return
    key = _key("onednn", *w.wt.shape, dtype, rows)
    packed = onednn_int8.OnednnInt8Weight.pack(w.wt) if env == "onednn" or _CALIBRATED.get(key, 1) else None
    if env != "onednn" and key not in _CALIBRATED:
        _remember(key, int(_onednn_wins(w, packed, dtype, rows)))
    w.onednn = packed if env == "onednn" or _CALIBRATED[key] else None


def _onednn_wins(w: smooth.W8A8Weight, packed: onednn_int8.OnednnInt8Weight, dtype: torch.dtype,
                 rows: tuple[int, ...]) -> bool:
    """oneDNN's product beats `_int_mm` by 5% summed over `rows`; a loss by PROBE_LOSS at the first row count
    ends the measurement there (a reference kernel would otherwise take seconds a call at 512 rows)."""
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


def _measure_max_rows(lin: nn.Module, candidates: tuple[int, ...]) -> int:
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
    """Best time of each of `fns`, run in turns after a warm-up (a slow spell of a shared host hits them
    alike; timed one after the other, a close choice can flip between starts on a noisy host)."""
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
