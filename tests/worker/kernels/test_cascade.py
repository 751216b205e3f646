"""Shared-prefix (cascade) prefill attention against SDPA per chunk, over model-dtype and int8 pages."""

from __future__ import annotations

import pytest
import torch

from worker.config import ModelConfig
from worker.kernels import cascade
from worker.kvcache.tensors import KVCache
from worker.model.attention import BatchLayout, TorchAttention

HEADS, KV_HEADS, HEAD_DIM, BS = 9, 3, 64, 16
SHARED = list(range(40, 60))  # 20 pages: a 320-token cached prefix the radix cache shares


def _cache(dtype: torch.dtype, kv_dtype: str = "model") -> KVCache:
    cfg = ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=HEADS,
                      num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    kv = KVCache(cfg, 96, BS, dtype, torch.device("cpu"), kv_dtype=kv_dtype)
    k, v = torch.randn(KV_HEADS, 96 * BS, HEAD_DIM) * 2, torch.randn(KV_HEADS, 96 * BS, HEAD_DIM)
    if kv.quantized:
        scale_k = k.view(KV_HEADS, 96, -1).abs().amax(-1) / 127
        scale_v = v.view(KV_HEADS, 96, -1).abs().amax(-1) / 127
        kv.k[0].copy_((k / scale_k.repeat_interleave(BS, 1)[..., None]).round())
        kv.v[0].copy_((v / scale_v.repeat_interleave(BS, 1)[..., None]).round())
        kv.k_scale[0].copy_(scale_k)
        kv.v_scale[0].copy_(scale_v)
    else:
        kv.k[0].copy_(k)
        kv.v[0].copy_(v)
    return kv


def _step() -> tuple[BatchLayout, int]:
    """Two decodes, then: three chunks after the shared prefix (one with 10 more cached tokens of its own),
    a chunk over another prefix, and a fresh prompt."""
    tables = [SHARED + [1, 2], SHARED + [3], SHARED + [4, 5, 6], list(range(7, 30)), [30, 31]]
    ctx = [320 + 10 + 20, 320 + 9, 320 + 33, 300 + 12, 25]
    q_lens = [20, 9, 33, 12, 25]
    decode_tables, decode_ctx = [SHARED + [60], [61, 62]], [330, 20]
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(decode_tables, decode_ctx, strict=True)]
    for t, q, n in zip(tables, q_lens, ctx, strict=True):
        slots += [t[i // BS] * BS + i % BS for i in range(n - q, n)]
    lay = BatchLayout(BS, torch.tensor(slots), decode_tables, decode_ctx, tables, q_lens, ctx)
    return lay, len(slots)


def _both(kv: KVCache, dtype: torch.dtype, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, list]:
    torch.manual_seed(3)
    lay, rows = _step()
    q = torch.randn(rows, HEADS, HEAD_DIM).mul(2).to(dtype)
    k_new = torch.randn(rows, KV_HEADS, HEAD_DIM).mul(2).to(dtype)
    v_new = torch.randn(rows, KV_HEADS, HEAD_DIM).to(dtype)
    attn = TorchAttention(HEADS, KV_HEADS, HEAD_DIM)
    meta = attn.prepare(lay, torch.device("cpu"))
    got = attn.forward(0, q, k_new, v_new, kv, meta).float()
    with monkeypatch.context() as m:
        m.setattr(cascade, "available", lambda device: False)
        ref_meta = attn.prepare(lay, torch.device("cpu"))
        ref = attn.forward(0, q, k_new, v_new, kv, ref_meta).float()
    return got, ref, meta.cascades


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_cascade_matches_sdpa_per_chunk(dtype, tol, kv_dtype, monkeypatch):
    got, ref, groups = _both(_cache(dtype, kv_dtype), dtype, monkeypatch)
    assert len(groups) == 1 and [m.q_len for m in groups[0].members] == [20, 9, 33]
    assert groups[0].shared_slots.numel() == 320
    assert (got - ref).abs().max().item() < tol
    assert torch.isfinite(got).all()


def test_plan_stops_at_the_first_page_the_chunks_do_not_share():
    tables = [SHARED + [1], SHARED[:17] + [2, 3, 4, 5]]
    groups, taken = cascade.plan(tables, [5, 5], [330, 330], [0, 5], BS)
    assert taken == {0, 1} and groups[0].shared_slots.numel() == 17 * BS
    assert groups[0].members[1].rest_slots[0].item() == 2 * BS  # the rest starts at its first own page
    groups, taken = cascade.plan(tables[:1], [5], [330], [0], BS)  # one chunk: nothing to share
    assert groups == [] and taken == set()
    groups, _ = cascade.plan([SHARED[:10] + [1], SHARED[:10] + [2]], [5, 5], [170, 170], [0, 5], BS)
    assert groups == []  # 160 common tokens: below MIN_SHARED


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_long_chunk_over_a_cached_prefix_matches_the_masked_product(dtype, tol, monkeypatch):
    """A chunk of SPLIT_MIN_Q tokens or more after a cached prefix takes the prefix unmasked and itself
    causally (`cascade.after_prefix`), with the masked product's result; a shorter one keeps the mask."""
    kv = _cache(dtype)
    calls: list[int] = []
    split = cascade.after_prefix

    def counted(q: torch.Tensor, *rest: torch.Tensor | float) -> torch.Tensor:
        calls.append(q.shape[0])
        return split(q, *rest)

    table, past = list(range(70, 90)), 150
    for q_len in (cascade.SPLIT_MIN_Q + 6, cascade.SPLIT_MIN_Q - 1):
        ctx = past + q_len
        slots = [table[i // BS] * BS + i % BS for i in range(past, ctx)]
        lay = BatchLayout(BS, torch.tensor(slots), [], [], [table], [q_len], [ctx])
        torch.manual_seed(5)
        q = torch.randn(q_len, HEADS, HEAD_DIM).mul(2).to(dtype)
        k_new = torch.randn(q_len, KV_HEADS, HEAD_DIM).mul(2).to(dtype)
        v_new = torch.randn(q_len, KV_HEADS, HEAD_DIM).to(dtype)
        attn = TorchAttention(HEADS, KV_HEADS, HEAD_DIM)
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(cascade, "after_prefix", counted)
            got = attn.forward(0, q, k_new, v_new, kv, attn.prepare(lay, torch.device("cpu"))).float()
        with monkeypatch.context() as m:
            m.setattr(cascade, "available", lambda device: False)
            ref = attn.forward(0, q, k_new, v_new, kv, attn.prepare(lay, torch.device("cpu"))).float()
        assert calls == ([q_len] if q_len >= cascade.SPLIT_MIN_Q else [])
        assert (got - ref).abs().max().item() < tol and torch.isfinite(got).all()
