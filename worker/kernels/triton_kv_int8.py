"""The quantizing K/V write into int8 pages, in Triton: `worker.kvcache.quant.write_int8`'s rule, code for
code.

One fp32 scale per (kv head, page). A step's tokens of one page are one group (they are contiguous in the slot
mapping: a page belongs to one sequence); the group's first token writes the whole group, so no two programs
touch one page. Runs under TRITON_INTERPRET=1 on CPU tensors like the attention kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kvcache.quant import GROW, QMAX

__all__ = ["paged_kv_write_int8"]

# 1.5 * 2**23: (x + _RNE) - _RNE rounds an fp32 |x| < 2**22 half to even, as torch.round does
_RNE = tl.constexpr(12582912.0)


@triton.jit
def _round_int8(x):
    x = tl.minimum(tl.maximum(x, -128.0), 128.0)
    r = (x + _RNE) - _RNE
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


@triton.jit
def _spread(flag, idx):
    """A scalar flag as a boolean vector shaped like `idx` (a scalar bool would promote a mask to int32)."""
    return (idx * 0 + flag.to(tl.int32)) != 0


@triton.jit
def _in_group(slot_ptr, t, i, n_tokens, page, PAGE: tl.constexpr):
    """(token t + i is in the group of `page`, its slot)."""
    s = tl.load(slot_ptr + t + i, mask=t + i < n_tokens, other=-1).to(tl.int64)
    return (s >= 0) & (s // PAGE == page), s


@triton.jit
def _quantize_group(x_ptr, stride_t, stride_h, c_ptr, s_ptr, slot_ptr, t, n_tokens, page, first, leader,
                    num_slots, KVH: tl.constexpr, KVH_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    PAGE: tl.constexpr, GROW_F: tl.constexpr, QMAX_F: tl.constexpr):
    """The leader's group of rows of x (K or V) into the codes at c_ptr and the scales at s_ptr, every kv
    head."""
    h = tl.arange(0, KVH_PAD)
    d = tl.arange(0, D_PAD)
    hd_mask = (h < KVH)[:, None] & (d < D)[None, :]
    x_off = h[:, None] * stride_h + d[None, :]
    amax = tl.zeros([KVH_PAD], dtype=tl.float32)
    span = tl.where(leader, PAGE - first, 0)  # a group starting at offset `first` holds at most PAGE - first
    for i in range(0, span):  # the group's absmax per head
        ok, _s = _in_group(slot_ptr, t, i, n_tokens, page, PAGE)
        act = _spread(ok & leader, h)
        x = tl.load(x_ptr + (t + i) * stride_t + x_off, mask=hd_mask & act[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    head_ok = (h < KVH) & _spread(leader, h)
    s_addr = s_ptr + h.to(tl.int64) * (num_slots // PAGE) + page
    old = tl.load(s_addr, mask=head_ok, other=0.0)
    want = amax / QMAX_F
    fresh = first == 0
    grows = _spread(first != 0, h) & (want > old)
    new = tl.where(_spread(fresh, h), want, tl.where(grows, tl.maximum(want, old * GROW_F), old))
    ratio = tl.where(grows, old / tl.where(grows, new, 1.0), 1.0)
    c_head = h.to(tl.int64)[:, None] * num_slots * D + d[None, :]
    for j in range(0, tl.where(tl.max(grows.to(tl.int32), 0) > 0, first, 0)):  # rows written before, regrown
        r_mask = hd_mask & (grows & head_ok)[:, None]
        addr = c_ptr + c_head + (page * PAGE + j) * D
        codes = tl.load(addr, mask=r_mask, other=0).to(tl.float32)
        tl.store(addr, _round_int8(codes * ratio[:, None]), mask=r_mask)
    tl.store(s_addr, new, mask=head_ok)
    inv = tl.where(new > 0, 1.0 / tl.where(new > 0, new, 1.0), 0.0)
    for i in range(0, span):
        ok, s = _in_group(slot_ptr, t, i, n_tokens, page, PAGE)
        w_mask = hd_mask & _spread(ok & leader, h)[:, None]
        x = tl.load(x_ptr + (t + i) * stride_t + x_off, mask=w_mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + c_head + s * D, _round_int8(x * inv[:, None]), mask=w_mask)


@triton.jit
def _kv_write_int8_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, n_tokens, stride_kt,
                          stride_kh, stride_vt, stride_vh, num_slots, KVH: tl.constexpr,
                          KVH_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                          GROW_F: tl.constexpr, QMAX_F: tl.constexpr):
    """One program per token; only a group's first token (slot >= 0, its predecessor on another page)
    works."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    prev = tl.load(slot_ptr + t - 1, mask=t > 0, other=-1).to(tl.int64)
    page = tl.where(slot >= 0, slot // PAGE, -1)
    leader = (slot >= 0) & ((prev < 0) | (prev // PAGE != page))
    first = slot % PAGE
    _quantize_group(k_ptr, stride_kt, stride_kh, kc_ptr, ks_ptr, slot_ptr, t, n_tokens, page, first, leader,
                    num_slots, KVH, KVH_PAD, D, D_PAD, PAGE, GROW_F, QMAX_F)
    _quantize_group(v_ptr, stride_vt, stride_vh, vc_ptr, vs_ptr, slot_ptr, t, n_tokens, page, first, leader,
                    num_slots, KVH, KVH_PAD, D, D_PAD, PAGE, GROW_F, QMAX_F)


def paged_kv_write_int8(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                        ks: torch.Tensor, vs: torch.Tensor, slots: torch.Tensor, page: int) -> None:
    """k, v: [T, kvh, hd] quantized into int8 kc, vc [kvh, slots, hd] at `slots` [T] (-1: skip the row),
    updating the fp32 scales ks, vs [kvh, pages]."""
    t, kvh, hd = k.shape
    if t == 0:
        return
    _kv_write_int8_kernel[(t,)](k, v, kc, vc, ks, vs, slots, t, k.stride(0), k.stride(1), v.stride(0),
                                v.stride(1), kc.shape[1], KVH=kvh, KVH_PAD=triton.next_power_of_2(kvh),
                                D=hd, D_PAD=max(16, triton.next_power_of_2(hd)), PAGE=page, GROW_F=GROW,
                                QMAX_F=QMAX)
