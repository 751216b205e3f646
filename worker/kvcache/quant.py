"""8-bit KV pages in torch: the quantizing write and the dequantizing gather (the reference of
`csrc/kv_int8.cpp`).

Symmetric absmax int8, one fp32 scale per (kv head, page); the scale rule and its error bound are in
docs/engine.md.
"""

from __future__ import annotations

import torch

QMAX = 127.0
# A page's scale grows by at least this factor when an appended row exceeds it, so an element's rounding
# errors over any number of growths sum to at most GROW / (GROW - 1) / 2 steps of the final scale.
GROW = 2.0


def error_bound(scale: torch.Tensor, grew: bool = True) -> torch.Tensor:
    """The largest |x - dequantized x| under `scale`: half a step, or GROW / (GROW - 1) / 2 steps after
    growths."""
    return scale * (GROW / (GROW - 1) / 2 if grew else 0.5)


def write_int8(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor,
               block_size: int) -> None:
    """Quantize x [T, kvh, hd] into cache [kvh, slots, hd] (int8) at `slot_mapping`, updating scales [kvh,
    pages].

    A page's tokens in the step are one group: starting at the page's first slot, it takes the group's scale;
    else a group whose absmax exceeds the page's range grows the scale and requantizes the rows before it."""
    kvh, hd = cache.shape[0], cache.shape[2]
    pages = slot_mapping // block_size
    upages, inverse = torch.unique(pages, return_inverse=True)
    n = upages.numel()
    first = torch.full((n,), block_size, dtype=torch.int64, device=x.device).scatter_reduce_(
        0, inverse, slot_mapping % block_size, "amin")
    row_max = x.float().abs().amax(-1).transpose(0, 1)  # [kvh, T]
    amax = torch.zeros(kvh, n, device=x.device).scatter_reduce_(1, inverse.expand(kvh, -1), row_max, "amax")
    old = scales[:, upages]  # [kvh, n]
    want = amax / QMAX
    fresh = (first == 0).expand(kvh, -1)
    grows = ~fresh & (want > old)
    new = torch.where(fresh, want, torch.where(grows, torch.maximum(want, old * GROW), old))
    if grows.any():
        view = cache.view(kvh, -1, block_size, hd)
        rows = view[:, upages].float()  # [kvh, n, bs, hd]: rows at or past `first` are rewritten or dead
        ratio = torch.where(grows, old / new, torch.ones_like(old))
        view[:, upages] = _round(rows * ratio[..., None, None])
    scales[:, upages] = new
    inv = torch.where(new > 0, 1 / new, torch.zeros_like(new))[:, inverse]  # [kvh, T]
    q = _round(x.float().transpose(0, 1) * inv[..., None])
    cache.index_copy_(1, slot_mapping, q)


def _round(x: torch.Tensor) -> torch.Tensor:
    return x.round_().clamp_(-QMAX, QMAX).to(torch.int8)


def dequantize_slots(cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, block_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """Rows `slots` of cache [kvh, slots, hd] as [kvh, len(slots), hd] in `dtype`."""
    rows = cache.index_select(1, slots).float()
    return (rows * scales[:, slots // block_size, None]).to(dtype)
