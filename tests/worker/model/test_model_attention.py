"""The C++ paged decode and prefill kernels against the torch reference attention (same cache and layout)."""

from __future__ import annotations

import random

import pytest
import torch

from worker.config import ModelConfig
from worker.kernels.cpu import paged_decode_kernel, paged_kv_write_kernel, paged_prefill_kernel
from worker.kvcache.tensors import KVCache
from worker.model.attention import BatchLayout, TorchAttention


def _random_cache(heads: int, kv_heads: int, head_dim: int, pages: int, dtype: torch.dtype,
                  k_scale: float = 1.0) -> KVCache:
    """One layer of 16-token pages filled with normal K (times `k_scale`: peakier softmax) and V."""
    cfg = ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim)
    kv = KVCache(cfg, pages, 16, dtype, torch.device("cpu"))
    kv.k[0].copy_(torch.randn_like(kv.k[0], dtype=torch.float32) * k_scale)
    kv.v[0].copy_(torch.randn_like(kv.v[0], dtype=torch.float32))
    return kv


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 32), (9, 3, 64), (8, 2, 128)])
def test_cpu_decode_kernel_matches_reference(dtype, tol, heads, kv_heads, head_dim):
    """Runtime-sized shapes (32) and the kernel's unrolled ones (64 x 3 as in SmolLM2, 128 x 4 as in Llama
    3)."""
    kernel = paged_decode_kernel()
    assert kernel is not None, "C++ kernel failed to build (compiler missing?)"
    torch.manual_seed(0)
    bs, pages = 16, 64
    kv = _random_cache(heads, kv_heads, head_dim, pages, dtype)
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
    for attn in (TorchAttention(heads, kv_heads, head_dim),
                 TorchAttention(heads, kv_heads, head_dim, kernel)):
        meta = attn.prepare(lay, torch.device("cpu"))
        outs.append(attn.forward(0, q, k_new, k_new, kv, meta).float())
    assert (outs[0] - outs[1]).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_and_strided_queries_equal_the_copying_path(dtype):
    """One `paged_kv_write` call stores what two index_copy_ calls store, and the decode kernel reads q, k, v
    as views into a fused QKV output (no contiguous copies) with the same result, bit for bit; a bad slot
    raises."""
    kernel, kv_write = paged_decode_kernel(), paged_kv_write_kernel()
    assert kernel is not None and kv_write is not None
    torch.manual_seed(3)
    heads, kv_heads, hd, bs, pages = 9, 3, 64, 16, 32
    ctx = [3, 16, 33, 70, 5, 120]
    tables = [list(range(sum(-(-n // bs) for n in ctx[:i]), sum(-(-n // bs) for n in ctx[:i + 1])))
              for i in range(len(ctx))]
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, ctx, strict=True)])
    qkv = torch.randn(len(ctx), heads + 2 * kv_heads, hd).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    lay = BatchLayout(bs, slots, tables, ctx, [], [], [])
    caches, outs = [], []
    for attn in (TorchAttention(heads, kv_heads, hd, kernel),
                 TorchAttention(heads, kv_heads, hd, kernel, kv_write=kv_write)):
        kv = _random_cache(heads, kv_heads, hd, pages, dtype)  # same seed state: reset below
        torch.manual_seed(4)
        kv.k[0].copy_(torch.randn_like(kv.k[0], dtype=torch.float32))
        kv.v[0].copy_(torch.randn_like(kv.v[0], dtype=torch.float32))
        outs.append(attn.forward(0, q, k, v, kv, attn.prepare(lay, torch.device("cpu"))))
        caches.append(kv)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    assert torch.equal(caches[1].k[0][:, slots], k.transpose(0, 1))
    with pytest.raises(RuntimeError, match="slot out of range"):
        kv_write(k, v, caches[1].k[0], caches[1].v[0], torch.full_like(slots, pages * bs))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (8, 8, 64), (16, 2, 64)])
def test_cpu_prefill_kernel_matches_reference(dtype, tol, heads, kv_heads, head_dim):
    """A step of two decodes and four prompt chunks (fresh, after a cached prefix, one token, past a page
    edge): the prefill kernel against SDPA per chunk, decode rows untouched by it."""
    kernel = paged_prefill_kernel(heads, kv_heads, head_dim)
    assert kernel is not None, "C++ prefill kernel failed to build or does not take this shape"
    torch.manual_seed(1)
    bs, pages = 16, 96
    kv = _random_cache(heads, kv_heads, head_dim, pages, dtype, k_scale=2.0)
    free = list(range(pages))
    random.Random(1).shuffle(free)
    decode_ctx, past, q_lens = [9, 33], [0, 48, 100, 13], [37, 5, 1, 200]
    dec_tables = [[free.pop() for _ in range(-(-n // bs))] for n in decode_ctx]
    ctx = [p + q for p, q in zip(past, q_lens, strict=True)]
    pre_tables = [[free.pop() for _ in range(-(-n // bs))] for n in ctx]
    slot = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(dec_tables, decode_ctx, strict=True)]
    for t, p, n in zip(pre_tables, past, ctx, strict=True):
        slot += [t[i // bs] * bs + i % bs for i in range(p, n)]
    rows = len(slot)
    q = torch.randn(rows, heads, head_dim).mul(2).to(dtype)
    k_new = torch.randn(rows, kv_heads, head_dim).mul(2).to(dtype)
    v_new = torch.randn(rows, kv_heads, head_dim).to(dtype)
    lay = BatchLayout(bs, torch.tensor(slot), dec_tables, decode_ctx, pre_tables, q_lens, ctx)
    outs = []
    for attn in (TorchAttention(heads, kv_heads, head_dim),
                 TorchAttention(heads, kv_heads, head_dim, None, kernel)):
        meta = attn.prepare(lay, torch.device("cpu"))
        outs.append(attn.forward(0, q, k_new, v_new, kv, meta).float())
    assert torch.equal(outs[0][:2], outs[1][:2])
    assert (outs[0] - outs[1]).abs().max().item() < tol


def test_prefill_kernel_declines_shapes_it_does_not_unroll():
    assert paged_prefill_kernel(9, 3, 32) is None  # head size
    assert paged_prefill_kernel(10, 2, 64) is None  # a group of 5 fills no 4, 6 or 8 rows


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-5), (torch.bfloat16, 2e-2)])
def test_cpu_prefill_kernel_packs_shared_prefix_pages_once_and_stays_exact(dtype, tol):
    """Three chunks after one cached 64-token prefix (the same four pages, as the prefix cache shares them),
    one of them ending inside its last page: the kernel packs each page once; outputs match SDPA per chunk."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    kernel = paged_prefill_kernel(heads, kv_heads, head_dim)
    assert kernel is not None
    torch.manual_seed(2)
    kv = _random_cache(heads, kv_heads, head_dim, 32, dtype, k_scale=2.0)
    shared, past, q_lens = [7, 3, 12, 0], 64, [20, 9, 33]
    tails = [[20, 21], [22], [23, 24, 25]]
    tables = [shared + t for t in tails]
    ctx = [past + q for q in q_lens]
    slot = [t[i // bs] * bs + i % bs for t, n in zip(tables, ctx, strict=True) for i in range(past, n)]
    rows = len(slot)
    q = torch.randn(rows, heads, head_dim).mul(2).to(dtype)
    k_new = torch.randn(rows, kv_heads, head_dim).mul(2).to(dtype)
    v_new = torch.randn(rows, kv_heads, head_dim).to(dtype)
    lay = BatchLayout(bs, torch.tensor(slot), [], [], tables, q_lens, ctx)
    outs = []
    for attn in (TorchAttention(heads, kv_heads, head_dim),
                 TorchAttention(heads, kv_heads, head_dim, None, kernel)):
        outs.append(attn.forward(0, q, k_new, v_new, kv, attn.prepare(lay, torch.device("cpu"))).float())
    assert (outs[0] - outs[1]).abs().max().item() < tol


def _shared_prefix_batch(bs: int, pages: int) -> tuple[list[list[int]], list[int]]:
    """Block tables where sequences share leading pages as the radix cache makes them: eight over five common
    pages (one of them ending on a page boundary), two over one, and three that share nothing."""
    rng = random.Random(5)
    free = list(range(pages))
    rng.shuffle(free)
    common, pair = [free.pop() for _ in range(5)], [free.pop()]
    tables, lens = [], []
    for extra in (1, 7, 16, 20, 3, 33, 12, 9):
        n = 5 * bs + extra
        tables.append(common + [free.pop() for _ in range(-(-n // bs) - 5)])
        lens.append(n)
    for extra in (2, 30):
        tables.append(pair + [free.pop() for _ in range(-(-(bs + extra) // bs) - 1)])
        lens.append(bs + extra)
    for n in (1, 5 * bs, 44):
        tables.append([free.pop() for _ in range(-(-n // bs))])
        lens.append(n)
    return tables, lens


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_over_shared_pages_equals_each_sequence_alone(int8, dtype, heads, kv_heads, head_dim, threads):
    """Sequences whose tables share leading pages are read as one unit (each shared page once for all of
    them): every output row is bit for bit the one the kernel gives that sequence alone, with 1 or 2
    threads."""
    from worker.kernels.cpu import int8_kv_kernels

    torch.manual_seed(7)
    bs, pages = 16, 96
    tables, lens = _shared_prefix_batch(bs, pages)
    width = max(len(t) for t in tables)
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    ln = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    if int8:
        decode = int8_kv_kernels(heads, kv_heads, head_dim)[0]
        kc = torch.randint(-127, 128, (kv_heads, pages * bs, head_dim), dtype=torch.int8)
        vc = torch.randint(-127, 128, (kv_heads, pages * bs, head_dim), dtype=torch.int8)
        ks, vs = torch.rand(kv_heads, pages) / 50, torch.rand(kv_heads, pages) / 50

        def run(qq, tt, ll):
            return decode(qq, kc, vc, ks, vs, tt, ll, bs, head_dim ** -0.5)
    else:
        decode = paged_decode_kernel()
        kc = torch.randn(kv_heads, pages * bs, head_dim).to(dtype)
        vc = torch.randn(kv_heads, pages * bs, head_dim).to(dtype)

        def run(qq, tt, ll):
            return decode(qq, kc, vc, tt, ll, bs, head_dim ** -0.5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = run(q, tab, ln)
        alone = torch.cat([run(q[i:i + 1], tab[i:i + 1], ln[i:i + 1]) for i in range(len(lens))])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
