"""The CPU C++ kernels against their torch references, same process, same inputs: the race sampler, the
candidate-first top-p restriction (against a full sort) and paged decode attention. One JSON line of ratios;
a measurement tool with no targets of its own: it exits 0.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable

import torch

from bench.machine import cpu_model, emit, machine_fields
from worker.config import ModelConfig
from worker.kernels.cpu import paged_decode_kernel, race_sample_kernel
from worker.kvcache.tensors import KVCache
from worker.model.attention import BatchLayout, TorchAttention
from worker.model.loader import pick_dtype
from worker.sample.sampler import SamplingBatch, race_draw, restrict_logits

VOCAB = 49152  # the default model's


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1e3


def _batch(n: int) -> SamplingBatch:
    z = torch.zeros(n, dtype=torch.int64)
    return SamplingBatch(torch.ones(n), z, torch.full((n,), 0.95),
                         torch.arange(n, dtype=torch.int64), z, False, False, True, False)


def sampler(rows: int, reps: int) -> dict:
    """Drawing from softmax probabilities of peaked random logits: the torch race vs the C++ one."""
    kernel = race_sample_kernel()
    probs = torch.softmax(torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 6, dim=-1)
    b = _batch(rows)
    torch_ms = median_ms(lambda: race_draw(probs.clone(), b), reps)
    out = {"rows": rows, "torch_ms": round(torch_ms, 2)}
    if kernel is not None:
        none = torch.empty(0, dtype=torch.int64)
        ms = median_ms(lambda: kernel(probs, b.seed, b.step, none), reps)
        out |= {"kernel_ms": round(ms, 2), "speedup": round(torch_ms / ms, 2)}
    return out


def full_sort_restrict(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The definition, and the baseline: sort every row of the vocabulary, keep its top k, then keep while the
    mass before a token (renormalized over those k, in float64) is < top_p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    keep = torch.zeros_like(sorted_logits, dtype=torch.bool)
    keep[:, :top_k or logits.shape[-1]] = True
    if top_p < 1:
        keep &= prefix_mass(sorted_logits, keep) < top_p
    return logits.masked_fill(~torch.zeros_like(keep).scatter_(-1, order, keep), float("-inf"))


def prefix_mass(sorted_logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """float64: the mass before each sorted token, renormalized over the kept ones (softmax, then cumsum)."""
    probs = torch.softmax(sorted_logits.double().masked_fill(~keep, float("-inf")), dim=-1)
    return torch.cumsum(probs, dim=-1) - probs


def restriction(rows: int, reps: int) -> dict:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1)) * 6
    top_k, top_p = torch.zeros(rows, dtype=torch.int64), torch.full((rows,), 0.95)
    sort_ms = median_ms(lambda: full_sort_restrict(logits, 0, 0.95), reps)
    ms = median_ms(lambda: restrict_logits(logits, top_k, top_p), reps)
    return {"rows": rows, "top_p": 0.95, "full_sort_ms": round(sort_ms, 2), "candidates_ms": round(ms, 2),
            "speedup": round(sort_ms / ms, 2)}


def attention(streams: int, context: int, dtype: torch.dtype, reps: int) -> dict:
    """One layer of the default model's decode attention (9 query heads, 3 KV heads, 64 wide) over
    `streams` sequences of `context` tokens in shuffled pages: torch gather + matmul vs the C++ kernel."""
    nh, kvh, hd, bs = 9, 3, 64, 16
    per_seq = -(-context // bs)
    cfg = ModelConfig(vocab_size=8, hidden_size=nh * hd, intermediate_size=8, num_layers=1, num_heads=nh,
                      num_kv_heads=kvh, head_dim=hd)
    kv = KVCache(cfg, streams * per_seq + 1, bs, dtype, torch.device("cpu"))
    kv.k[0].normal_()
    kv.v[0].normal_()
    pages = list(range(streams * per_seq))
    random.Random(0).shuffle(pages)
    tables = [pages[i * per_seq:(i + 1) * per_seq] for i in range(streams)]
    slots = torch.tensor([t[(context - 1) // bs] * bs + (context - 1) % bs for t in tables])
    lay = BatchLayout(bs, slots, tables, [context] * streams, [], [], [])
    q = torch.randn(streams, nh, hd).to(dtype)
    k = torch.randn(streams, kvh, hd).to(dtype)
    out = {"streams": streams, "context": context, "dtype": str(dtype).replace("torch.", "")}
    kernel = paged_decode_kernel()
    for name, attn in (("torch", TorchAttention(nh, kvh, hd)),
                       ("kernel", TorchAttention(nh, kvh, hd, kernel))):
        if name == "kernel" and kernel is None:
            break
        meta = attn.prepare(lay, torch.device("cpu"))
        out[f"{name}_ms"] = round(median_ms(lambda a=attn, m=meta: a.forward(0, q, k, k, kv, m), reps), 3)
    if "kernel_ms" in out:
        out["speedup"] = round(out["torch_ms"] / out["kernel_ms"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    load = os.getloadavg()
    dtype = pick_dtype("auto", torch.device("cpu"))
    res = {"bench": "cpu_kernels", "cpu": cpu_model(), "dtype": str(dtype).replace("torch.", ""),
           "threads": torch.get_num_threads(),
           "sampler": [sampler(n, args.reps) for n in (1, 16, 64)],
           "top_p_restriction": [restriction(n, args.reps) for n in (1, 16)],
           "decode_attention": [attention(16, c, dtype, args.reps) for c in (128, 512, 1024)]}
    res |= machine_fields(load)
    return emit(res, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
