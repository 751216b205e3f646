"""The C++ paged decode kernel against the pure-torch reference attention (same cache, same layout)."""

from __future__ import annotations

import random

import pytest
import torch

from worker.attention import BatchLayout, TorchAttention
from worker.config import ModelConfig
from worker.cpu_kernels import paged_decode_kernel
from worker.kv_cache import KVCache


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 32), (9, 3, 64), (8, 2, 128)])
def test_cpu_decode_kernel_matches_reference(dtype, tol, heads, kv_heads, head_dim):
    """Runtime-sized shapes (32) and the kernel's unrolled ones (64 x 3 as in SmolLM2, 128 x 4 as in Llama 3)."""
    kernel = paged_decode_kernel()
    assert kernel is not None, "C++ kernel failed to build (compiler missing?)"
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim)
    bs, pages = 16, 64
    kv = KVCache(cfg, pages, bs, dtype, torch.device("cpu"))
    kv.k[0].copy_(torch.randn_like(kv.k[0], dtype=torch.float32))
    kv.v[0].copy_(torch.randn_like(kv.v[0], dtype=torch.float32))
    rng = random.Random(0)
    free = list(range(pages))
    rng.shuffle(free)
    ctx = [1, 17, 40, 100, 5]
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in ctx]
    q = torch.randn(len(ctx), heads, head_dim).to(dtype)
    k_new = torch.randn(len(ctx), kv_heads, head_dim).to(dtype)
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, ctx, strict=True)])
    lay = BatchLayout(bs, slots, tables, ctx, [], [], [])
    outs = []
    for attn in (TorchAttention(heads, kv_heads, head_dim), TorchAttention(heads, kv_heads, head_dim, kernel)):
        meta = attn.prepare(lay, torch.device("cpu"))
        outs.append(attn.forward(0, q, k_new, k_new, kv, meta).float())
    assert (outs[0] - outs[1]).abs().max().item() < tol
