"""The int8 paged decode kernel called directly, against attention on the dequantized pages: page sizes that
are not a multiple of the kernel's 16-key and 2-row steps, contexts ending anywhere in a page, scattered
pages, one scale per (kv head, page), and rows whose largest scores sit far from one another (the softmax's
row max)."""

from __future__ import annotations

import pytest
import torch

from worker.kernels.cpu import extension


def _reference(q, kc, vc, ks, vs, tables, lens, bs, scale):
    g = q.shape[1] // kc.shape[0]
    page_of = torch.arange(kc.shape[1]) // bs
    k = kc.float() * ks[:, page_of, None]
    v = vc.float() * vs[:, page_of, None]
    out = torch.empty(q.shape)
    for b, n in enumerate(lens.tolist()):
        slots = torch.cat([torch.arange(p * bs, (p + 1) * bs) for p in tables[b].tolist()])[:n]
        for h in range(q.shape[1]):
            probs = torch.softmax(q[b, h].float() @ k[h // g, slots].T * scale, -1)
            out[b, h] = probs @ v[h // g, slots]
    return out


@pytest.mark.parametrize("bs", [16, 5, 7, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128)])
def test_int8_decode_matches_dequantized_attention(bs, heads, kv_heads, head_dim):
    ext = extension()
    assert ext is not None, "C++ kernels failed to build (compiler missing?)"
    g = torch.Generator().manual_seed(bs)
    lens = torch.tensor([1, bs - 1, bs, bs + 1, 3 * bs + 2, 97, 300])
    per = -(-int(lens.max()) // bs)
    pages = len(lens) * per + 3
    order = torch.randperm(pages, generator=g)
    tables = order[: len(lens) * per].view(len(lens), per).contiguous()
    kc = torch.randint(-127, 128, (kv_heads, pages * bs, head_dim), generator=g, dtype=torch.int8)
    vc = torch.randint(-127, 128, (kv_heads, pages * bs, head_dim), generator=g, dtype=torch.int8)
    ks = torch.rand(kv_heads, pages, generator=g) * 0.05 + 0.005
    vs = torch.rand(kv_heads, pages, generator=g) * 0.05 + 0.005
    q = (torch.randn(len(lens), heads, head_dim, generator=g)
         * torch.rand(len(lens), heads, 1, generator=g) * 3)
    scale = head_dim ** -0.5
    want = _reference(q, kc, vc, ks, vs, tables, lens, bs, scale)
    got = ext.paged_decode_int8(q, kc, vc, ks, vs, tables, lens, bs, scale)
    assert (got - want).abs().max().item() < 1e-3 * max(1.0, want.abs().max().item())
    got16 = ext.paged_decode_int8(q.bfloat16(), kc, vc, ks, vs, tables, lens, bs, scale).float()
    assert (got16 - want).abs().max().item() < 3e-2 * max(1.0, want.abs().max().item())
