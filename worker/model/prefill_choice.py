"""Which prefill attention a CPU runner uses, measured once per process and shape: the C++ paged kernel or
torch's SDPA per chunk (its flash kernel runs oneDNN's brgemm, on AMX tiles where the CPU has them)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from worker.config import ModelConfig
from worker.kvcache.tensors import KVCache
from worker.model.attention import BatchLayout, TorchAttention

log = logging.getLogger(__name__)

PATH_ENV = "SWITCHYARD_PREFILL_ATTENTION"  # "kernel" or "sdpa" fixes the choice; unset: measured
# the measured step: one fresh 512-token prompt and a 64-token chunk over a 1,024-token cached prefix
PROBE_CHUNKS = ((512, 512), (64, 1088))
_CHOSEN: dict[tuple, str] = {}  # per process: by shape, dtypes and page size


def without_prefill_kernels(attn: TorchAttention) -> TorchAttention:
    """`attn` with prefill chunks on SDPA (decode and the K/V write keep their kernels)."""
    int8 = dataclasses.replace(attn.int8, prefill=None) if attn.int8 is not None else None
    return TorchAttention(attn.nh, attn.kvh, attn.hd, attn.kernel, None, attn.kv_write, int8)


def fixed_path() -> str | None:
    """`SWITCHYARD_PREFILL_ATTENTION` ("kernel" or "sdpa"), None when unset; any other value is an error."""
    path = os.environ.get(PATH_ENV) or None
    if path not in (None, "kernel", "sdpa"):
        raise ValueError(f"{PATH_ENV}={path!r}: use kernel or sdpa, or leave it unset (measured)")
    return path


def sdpa_wins(cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> bool:
    """Over model-dtype pages, SDPA per chunk beat the C++ prefill kernel by 10% on a one-layer probe of this
    shape (measured once per process and key; `SWITCHYARD_PREFILL_ATTENTION` fixes the answer)."""
    path = fixed_path()
    if path is not None:
        return path == "sdpa"
    key = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype, block_size)
    if key not in _CHOSEN:
        _CHOSEN[key] = _measure(cfg, dtype, block_size)
    return _CHOSEN[key] == "sdpa"


def choose_prefill(attn: object, cfg: ModelConfig, kv: KVCache) -> object:
    """`attn`, or `attn` without its prefill kernels where SDPA is faster (about 2x on an Intel Xeon with AMX;
    the C++ kernel wins 2-3x on CPUs without it). Over int8 pages only where
    `SWITCHYARD_PREFILL_ATTENTION=sdpa` asks: SDPA reads them dequantized to the model dtype, whose rounding
    cost 0.5% perplexity (the C++ kernel keeps the scales in fp32)."""
    if not isinstance(attn, TorchAttention) or kv.k[0].device.type != "cpu":
        return attn
    kernel = attn.int8.prefill if kv.quantized and attn.int8 is not None else attn.prefill_kernel
    if kernel is None:
        attn.prefill_path = "sdpa"
        return attn
    if kv.quantized:
        sdpa = fixed_path() == "sdpa"
    else:
        sdpa = sdpa_wins(cfg, kv.dtype, kv.block_size)
    chosen = without_prefill_kernels(attn) if sdpa else attn
    chosen.prefill_path = "sdpa" if sdpa else "kernel"
    log.info("prefill attention: %s", "torch SDPA per chunk" if sdpa else "the C++ paged kernel")
    return chosen


def _measure(cfg: ModelConfig, dtype: torch.dtype, bs: int) -> str:
    """Time one layer of the probe step both ways on scratch model-dtype pages (best of 3 after a warm-up)."""
    from worker.model.backends import make_backend

    cpu = torch.device("cpu")
    attn = make_backend("torch", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bs, cpu)
    if attn.prefill_kernel is None:
        return "sdpa"
    pages = sum(-(-ctx // bs) for _, ctx in PROBE_CHUNKS)
    scratch = KVCache(dataclasses.replace(cfg, num_layers=1), pages, bs, dtype, cpu)
    tables, q_lens, ctx_lens, slots, fill = [], [], [], [], []
    first = 0
    for q_len, ctx in PROBE_CHUNKS:
        table = list(range(first, first + -(-ctx // bs)))
        first += len(table)
        tables.append(table), q_lens.append(q_len), ctx_lens.append(ctx)
        fill += [table[p // bs] * bs + p % bs for p in range(ctx)]
        slots += fill[len(fill) - q_len:]
    g = torch.Generator().manual_seed(0)

    def rand(n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, attn.hd, generator=g).to(dtype)

    lay = BatchLayout(bs, torch.tensor(slots), [], [], tables, q_lens, ctx_lens)
    n = sum(q_lens)
    q, k, v = rand(n, attn.nh), rand(n, attn.kvh), rand(n, attn.kvh)
    times = {}
    with torch.inference_mode():
        full = torch.tensor(fill)
        attn.forward(0, rand(len(fill), attn.nh), rand(len(fill), attn.kvh), rand(len(fill), attn.kvh),
                     scratch, attn.prepare(BatchLayout(bs, full, [], [], tables, ctx_lens, ctx_lens), cpu))
        for path, a in (("kernel", attn), ("sdpa", without_prefill_kernels(attn))):
            meta = a.prepare(lay, cpu)
            a.forward(0, q, k, v, scratch, meta)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                a.forward(0, q, k, v, scratch, meta)
                best = min(best, time.perf_counter() - t0)
            times[path] = best
    log.info("prefill attention probe (model-dtype pages, one layer): C++ kernel %.2f ms, SDPA %.2f ms",
             times["kernel"] * 1e3, times["sdpa"] * 1e3)
    return "sdpa" if times["sdpa"] < 0.9 * times["kernel"] else "kernel"
