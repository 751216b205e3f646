"""8-bit KV pages: the scale rule's error bound, the C++ write and attention kernels against the torch
reference, and the page budget."""

from __future__ import annotations

import random

import pytest
import torch

from worker.config import EngineConfig, ModelConfig
from worker.kernels.cpu import int8_kv_kernels
from worker.kvcache import quant
from worker.kvcache.tensors import KVCache, bytes_per_page, num_pages_for
from worker.model.attention import BatchLayout, Int8Kernels, TorchAttention

BS = 16
CPU = torch.device("cpu")


def _cfg(heads: int, kv_heads: int, head_dim: int, layers: int = 1) -> ModelConfig:
    return ModelConfig(vocab_size=10, hidden_size=heads * head_dim, intermediate_size=8, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def _kernels(heads: int, kv_heads: int, head_dim: int) -> Int8Kernels:
    found = int8_kv_kernels(heads, kv_heads, head_dim)
    assert found is not None, "C++ kernels failed to build (compiler missing?)"
    return Int8Kernels(*found)


def _appends(kv_heads: int, head_dim: int, n: int, seed: int) -> torch.Tensor:
    """n token rows whose magnitude drifts up and down, so pages grow their scales several times."""
    g = torch.Generator().manual_seed(seed)
    gain = torch.exp(torch.randn(n, generator=g).cumsum(0) * 0.3)[:, None, None]
    return torch.randn(n, kv_heads, head_dim, generator=g) * gain


def _write(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: list[int], steps: list[int],
           kernel=None) -> None:
    """Write x's rows in steps of the given sizes (a prefill chunk, then appends), by the kernel or the
    reference."""
    pos = 0
    for n in steps:
        sm = torch.tensor(slots[pos:pos + n])
        if kernel is None:
            quant.write_int8(x[pos:pos + n], cache, scales, sm, BS)
        else:
            kernel(x[pos:pos + n], x[pos:pos + n], cache, cache.clone(), scales, scales.clone(), sm, BS,
                   quant.GROW)
        pos += n


def test_error_bound_and_scales_that_only_grow():
    """Every element within GROW / (GROW - 1) / 2 steps of its page-head's final scale, and within half a step
    on pages whose scale never grew; a page's scale never shrinks while tokens are appended to it."""
    kvh, hd, n = 3, 64, 150
    x = _appends(kvh, hd, n, seed=0)
    pages = [5, 2, 9, 0, 7, 11, 3, 4, 1, 6]
    slots = [pages[i // BS] * BS + i % BS for i in range(n)]
    cache, scales = torch.zeros(kvh, 12 * BS, hd, dtype=torch.int8), torch.zeros(kvh, 12)
    firsts = {}
    pos = 0
    for step in [37] + [1] * (n - 37):
        quant.write_int8(x[pos:pos + step], cache, scales, torch.tensor(slots[pos:pos + step]), BS)
        for i in range(pos, pos + step):
            page = pages[i // BS]
            firsts.setdefault(page, scales[:, page].clone())
            assert (scales[:, page] >= firsts[page]).all()
            firsts[page] = scales[:, page].clone()
        pos += step
    got = quant.dequantize_slots(cache, scales, torch.tensor(slots), BS, torch.float32).transpose(0, 1)
    err = (got - x).abs().amax(-1)  # [n, kvh]
    page_of = torch.tensor([pages[i // BS] for i in range(n)])
    final = scales[:, page_of].t()
    assert (err <= quant.error_bound(final) * 1.0001).all()
    # a page that took one 37-row write and no growth after: the plain absmax bound, and tight scales
    whole = torch.arange(32)  # pages 5 and 2: filled by the first write alone
    assert (err[whole] <= quant.error_bound(final[whole], grew=False) * 1.0001).all()
    grew = (final > x.abs().amax(-1) / quant.QMAX * 1.01).any()
    assert grew, "the drifting rows should have grown some page's scale"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_write_matches_reference(dtype):
    """Same rows, same steps: the C++ write and the torch reference store the same int8 rows and scales."""
    write = _kernels(9, 3, 64).write
    kvh, hd, n = 3, 64, 90
    x = _appends(kvh, hd, n, seed=1).to(dtype)
    pages = [3, 0, 5, 1, 4, 2]
    slots = [pages[i // BS] * BS + i % BS for i in range(n)]
    steps = [20, 1, 1, 13, 1, 1, 1, 1, 1, 50]
    out = []
    for kernel in (None, write):
        cache, scales = torch.full((kvh, 6 * BS, hd), 99, dtype=torch.int8), torch.full((kvh, 6), 7.0)
        _write(x, cache, scales, slots, steps, kernel)
        out.append((cache[:, slots], scales))
    assert torch.equal(out[0][1], out[1][1])
    assert (out[0][0].int() - out[1][0].int()).abs().max().item() == 0


def _int8_cache(heads: int, kv_heads: int, head_dim: int, pages: int, dtype: torch.dtype,
                seed: int) -> KVCache:
    """A cache whose every page was filled by the reference write from normal K (x2) and V."""
    kv = KVCache(_cfg(heads, kv_heads, head_dim), pages, BS, dtype, CPU, kv_dtype="int8")
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(pages * BS)
    quant.write_int8((torch.randn(pages * BS, kv_heads, head_dim, generator=g) * 2).to(dtype), kv.k[0],
                     kv.k_scale[0], slots, BS)
    quant.write_int8(torch.randn(pages * BS, kv_heads, head_dim, generator=g).to(dtype), kv.v[0],
                     kv.v_scale[0], slots, BS)
    return kv


def _run(attn: TorchAttention, lay: BatchLayout, kv: KVCache, q, k, v) -> torch.Tensor:
    return attn.forward(0, q, k, v, kv, attn.prepare(lay, CPU)).float()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 32)])
def test_decode_kernel_matches_reference(dtype, tol, heads, kv_heads, head_dim):
    """Contexts of 1 to 300 tokens (inside a page, on and across page edges), GQA groups of 3 and 4, the
    kernel's unrolled head sizes and a runtime one: int8 decode against the reference on dequantized gathers
    (fp32: within the int16 rounding of the queries and probabilities on the AVX-512 path)."""
    kernels = _kernels(heads, kv_heads, head_dim)
    torch.manual_seed(0)
    pages = 64
    free = list(range(pages))
    random.Random(0).shuffle(free)
    ctx = [1, 16, 17, 40, 300, 5, 33]
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in ctx]
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, ctx, strict=True)])
    lay = BatchLayout(BS, slots, tables, ctx, [], [], [])
    q = torch.randn(len(ctx), heads, head_dim).to(dtype)
    k, v = torch.randn(2, len(ctx), kv_heads, head_dim).to(dtype)
    outs, caches = [], []
    for attn in (TorchAttention(heads, kv_heads, head_dim),
                 TorchAttention(heads, kv_heads, head_dim, kernel=lambda *a: None, int8=kernels)):
        kv = _int8_cache(heads, kv_heads, head_dim, pages, dtype, seed=1)
        outs.append(_run(attn, lay, kv, q, k, v))
        caches.append(kv)
    assert torch.equal(caches[0].k[0], caches[1].k[0])
    assert torch.equal(caches[0].v_scale[0], caches[1].v_scale[0])
    assert (outs[0] - outs[1]).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_prefill_kernel_matches_reference(dtype, tol, heads, kv_heads, head_dim):
    """Two decodes and four chunks (fresh, after a cached prefix, one token, 200 tokens past page edges): the
    int8 prefill kernel against SDPA on dequantized rows, decode rows untouched by it (fp32: within the int16
    rounding of the queries and probabilities on AVX2 without AVX-512, as the decode kernel's on AVX-512)."""
    kernels = _kernels(heads, kv_heads, head_dim)
    assert kernels.prefill is not None
    torch.manual_seed(1)
    pages = 96
    free = list(range(pages))
    random.Random(1).shuffle(free)
    decode_ctx, past, q_lens = [9, 33], [0, 48, 100, 13], [37, 5, 1, 200]
    dec_tables = [[free.pop() for _ in range(-(-n // BS))] for n in decode_ctx]
    ctx = [p + q for p, q in zip(past, q_lens, strict=True)]
    pre_tables = [[free.pop() for _ in range(-(-n // BS))] for n in ctx]
    slot = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(dec_tables, decode_ctx, strict=True)]
    for t, p, n in zip(pre_tables, past, ctx, strict=True):
        slot += [t[i // BS] * BS + i % BS for i in range(p, n)]
    q = torch.randn(len(slot), heads, head_dim).mul(2).to(dtype)
    k = torch.randn(len(slot), kv_heads, head_dim).mul(2).to(dtype)
    v = torch.randn(len(slot), kv_heads, head_dim).to(dtype)
    lay = BatchLayout(BS, torch.tensor(slot), dec_tables, decode_ctx, pre_tables, q_lens, ctx)
    outs = []
    for attn in (TorchAttention(heads, kv_heads, head_dim),
                 TorchAttention(heads, kv_heads, head_dim, None, prefill_kernel=lambda *a: None,
                                int8=kernels)):
        outs.append(_run(attn, lay, _int8_cache(heads, kv_heads, head_dim, pages, dtype, seed=2), q, k, v))
    assert torch.equal(outs[0][:2], outs[1][:2])
    assert (outs[0] - outs[1]).abs().max().item() < tol


def test_int8_attention_stays_close_to_the_model_dtype():
    """The same K/V through int8 pages and through fp32 pages: decode outputs within the quantization's
    reach."""
    heads, kv_heads, hd, n = 9, 3, 64, 200
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, n, kv_heads, hd, generator=g)
    q = torch.randn(1, heads, hd, generator=g)
    table = list(range(-(-n // BS)))
    outs = []
    for kv_dtype in ("model", "int8"):
        kv = KVCache(_cfg(heads, kv_heads, hd), len(table), BS, torch.float32, CPU, kv_dtype=kv_dtype)
        attn = TorchAttention(heads, kv_heads, hd)
        prompt = BatchLayout(BS, torch.arange(n - 1), [], [], [table], [n - 1], [n - 1])
        _run(attn, prompt, kv, torch.randn(n - 1, heads, hd), k[:-1], v[:-1])
        outs.append(_run(attn, BatchLayout(BS, torch.tensor([n - 1]), [table], [n], [], [], []), kv, q,
                         k[-1:], v[-1:]))
    err = (outs[0] - outs[1]).abs().max().item()
    assert 0 < err < 0.02, err


def test_page_budget_counts_scales_and_doubles_the_tokens():
    """The default model's shape: int8 pages (scales included) take 64.25 of 128 bytes per token and element,
    so a bf16 budget holds 1.99x the tokens (fp32: 3.98x); the engine's page count follows."""
    cfg = _cfg(9, 3, 64, layers=30)
    bf16 = bytes_per_page(cfg, torch.bfloat16, BS)
    assert bytes_per_page(cfg, torch.bfloat16, BS, "int8") == 2 * 30 * 3 * (64 * BS + 4)
    assert bf16 / bytes_per_page(cfg, torch.bfloat16, BS, "int8") > 1.99
    budget = EngineConfig(kv_cache_bytes=64 << 20)
    model = num_pages_for(cfg, budget, torch.bfloat16, CPU)
    int8 = num_pages_for(cfg, budget, torch.bfloat16, CPU, "int8")
    fp32 = num_pages_for(cfg, budget, torch.float32, CPU)
    assert int8 / model >= 1.9 and num_pages_for(cfg, budget, torch.float32, CPU, "int8") / fp32 >= 3.8
    kv = KVCache(cfg, int8, BS, torch.bfloat16, CPU, kv_dtype="int8")
    held = sum(t.numel() * t.element_size() for t in kv.k + kv.v + kv.k_scale + kv.v_scale)
    assert held <= budget.kv_cache_bytes and kv.k[0].dtype == torch.int8
    with pytest.raises(ValueError, match="kv-dtype int8"):
        KVCache(cfg, 4, BS, torch.bfloat16, CPU, pages_first=True, kv_dtype="int8")
