"""Paged attention kernels in Triton, FlashAttention-style: tiled, online softmax, no [q, ctx] matrix.

The KV cache layout is the worker's own ([kv_heads, slots, head_dim] per layer, slot = page * page_size +
offset). Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests do so on every commit).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from worker.kernels.triton_ops import rotate_heads

__all__ = ["decode_splits", "paged_decode", "paged_kv_write", "paged_prefill", "paged_rope_kv_write"]


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     num_slots, KVH: tl.constexpr, KVH_PAD: tl.constexpr, D: tl.constexpr,
                     D_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, KVH_PAD)
    d = tl.arange(0, D_PAD)
    row_ok = (d * 0 + slot) >= 0  # slot -1: a padded row of a captured batch writes nothing
    mask = (h < KVH)[:, None] & ((d < D) & row_ok)[None, :]
    dst = h.to(tl.int64)[:, None] * num_slots * D + slot * D + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(kc_ptr + dst, k, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


@triton.jit
def _rope_kv_write_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, stride_t, stride_h,
                          num_slots, NH: tl.constexpr, KVH: tl.constexpr, N_PAD: tl.constexpr,
                          KVH_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """One token: q and k heads of x [T, heads, 2 * HALF] rotated in place (`triton_ops.rotate_heads`, which
    the RoPE kernel runs), then its rotated k and its v written to their slot (-1: none). One kernel for
    two."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h, i, r1, r2 = rotate_heads(x_ptr, t, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, NH + KVH, N_PAD,
                                HALF, HALF_PAD)
    row_ok = (i * 0 + slot) >= 0
    kmask = ((h >= NH) & (h < NH + KVH))[:, None] & ((i < HALF) & row_ok)[None, :]
    kdst = kc_ptr + (h - NH).to(tl.int64)[:, None] * num_slots * 2 * HALF + slot * 2 * HALF + i[None, :]
    tl.store(kdst, r1.to(kc_ptr.dtype.element_ty), mask=kmask)
    tl.store(kdst + HALF, r2.to(kc_ptr.dtype.element_ty), mask=kmask)
    g = tl.arange(0, KVH_PAD)
    vmask = (g < KVH)[:, None] & ((i < HALF) & row_ok)[None, :]
    vsrc = x_ptr + t.to(tl.int64) * stride_t + (NH + KVH + g)[:, None] * stride_h + i[None, :]
    vdst = vc_ptr + g.to(tl.int64)[:, None] * num_slots * 2 * HALF + slot * 2 * HALF + i[None, :]
    tl.store(vdst, tl.load(vsrc, mask=vmask), mask=vmask)
    tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=vmask), mask=vmask)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, vs_ptr, table_row, base, sbase, start, limit,
                 rows_pos, scale, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                 TILE: tl.constexpr, CAUSAL: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One online-softmax update of (acc, m, l) with the context positions [start, start + TILE) below
    `limit`.

    QUANT: int8 pages with one fp32 scale per (kv head, page) at ks/vs[sbase + page]; the tile's codes are
    cast to q's dtype (exact) and the scales applied to the scores and probabilities, never to a dequantized
    tile."""
    n = start + tl.arange(0, TILE)
    d = tl.arange(0, D_PAD)
    valid = n < limit
    page = tl.load(table_row + n // PAGE, mask=valid, other=0).to(tl.int64)
    addr = base + (page * PAGE + n % PAGE)[:, None] * D + d[None, :]
    kv_mask = valid[:, None] & (d < D)[None, :]
    k = tl.load(kc_ptr + addr, mask=kv_mask, other=0.0)
    if UPCAST:  # Triton's interpreter gets 16-bit tl.dot wrong: multiply in fp32 there
        q = q.to(tl.float32)
    k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if QUANT:
        k_scale = tl.load(ks_ptr + sbase + page, mask=valid, other=0.0)
        s = s * (k_scale * scale)[None, :]
    else:
        s = s * scale
    keep = valid[None, :]
    if CAUSAL:
        keep = keep & (n[None, :] <= rows_pos[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    v = tl.load(vc_ptr + addr, mask=kv_mask, other=0.0).to(q.dtype)
    pw = p
    if QUANT:
        pw = p * tl.load(vs_ptr + sbase + page, mask=valid, other=0.0)[None, :]
    if IEEE:
        pv = tl.dot(pw.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(pw.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, out_ptr, part_ptr, ml_ptr, table_ptr, lens_ptr,
                   scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, num_slots,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   PAGE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, QUANT: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One program per (sequence, kv head, split of the context): the GROUP query heads sharing the kv head
    attend to its pages together. With SPLITS > 1 each split leaves its unnormalized output, max and sum for
    the combine."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    q_mask = (g < GROUP)[:, None] & (d < D)[None, :]
    heads = h * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    base = h.to(tl.int64) * num_slots * D
    sbase = h.to(tl.int64) * (num_slots // PAGE)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    per_split = tl.cdiv(tl.cdiv(ctx, TILE), SPLITS) * TILE  # an equal share of the actual context
    lo = split * per_split
    hi = tl.minimum(ctx, lo + per_split)
    for start in range(lo, hi, TILE):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, vs_ptr, table_row, base, sbase,
                                     start, ctx, g, scale, D, D_PAD, PAGE, TILE, False, QUANT, IEEE, UPCAST)
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # ctx 0 (a padded row): zeros
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:  # partials [B, nh, SPLITS, D_PAD] and [B, nh, SPLITS, 2] (max, sum), fp32
        row = (b * GROUP * tl.num_programs(1) + heads).to(tl.int64) * SPLITS + split
        tl.store(part_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=q_mask)
        tl.store(ml_ptr + row * 2, m_i, mask=g < GROUP)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=g < GROUP)


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, NH: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    """One program per (sequence, query head): the splits' partial softmaxes merged into one output."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    row = (b * NH + h).to(tl.int64) * SPLITS + s
    m = tl.load(ml_ptr + row * 2, mask=s < SPLITS, other=float("-inf"))
    l_s = tl.load(ml_ptr + row * 2 + 1, mask=s < SPLITS, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # a padded row: every split empty
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # empty splits weigh nothing
    total = tl.sum(l_s * w, 0)
    acc = tl.load(part_ptr + row[:, None] * D_PAD + d[None, :], mask=(s < SPLITS)[:, None] & (d < D)[None, :],
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, out_ptr, table_ptr, q_start_ptr, q_len_ptr,
                    ctx_ptr, scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, num_slots,
                    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, TILE: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr,
                    UPCAST: tl.constexpr):
    """One program per (chunk, query head, tile of BLOCK_M query rows): causal over the cached prefix +
    chunk."""
    c = tl.program_id(0)
    qh = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(q_len_ptr + c)
    ctx = tl.load(ctx_ptr + c)
    row0 = tl.load(q_start_ptr + c)
    past = ctx - q_len
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    row_mask = (m < q_len)[:, None] & (d < D)[None, :]
    rows = (row0 + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + qh * stride_qh + d[None, :], mask=row_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    base = (qh // GROUP).to(tl.int64) * num_slots * D
    sbase = (qh // GROUP).to(tl.int64) * (num_slots // PAGE)
    table_row = table_ptr + c.to(tl.int64) * stride_tb
    # the tile's last row sees positions up to past + its index; a tile past the chunk's end sees nothing
    end = tl.where(tile * BLOCK_M < q_len, tl.minimum(ctx, past + (tile + 1) * BLOCK_M), 0)
    for start in range(0, end, TILE):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, vs_ptr, table_row, base, sbase,
                                     start, end, past + m, scale, D, D_PAD, PAGE, TILE, True, QUANT, IEEE,
                                     UPCAST)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + qh * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def _precision(dtype: torch.dtype) -> dict[str, bool]:
    """fp32 attends in full fp32 (no TF32); 16-bit types multiply natively, or in fp32 under the
    interpreter."""
    return {"IEEE": dtype == torch.float32,
            "UPCAST": dtype != torch.float32 and bool(triton.knobs.runtime.interpret)}


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def paged_kv_write(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """k, v: [T, kvh, hd] (last dim contiguous) into kc, vc [kvh, slots, hd] at `slots` [T] (-1: skip the
    row)."""
    t, kvh, hd = k.shape
    if t == 0:
        return
    _kv_write_kernel[(t,)](k, v, kc, vc, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           kc.shape[1], KVH=kvh, KVH_PAD=_pow2(kvh), D=hd, D_PAD=_pow2(hd, 16))


def paged_rope_kv_write(qkv: torch.Tensor, nh: int, positions: torch.Tensor, cos_table: torch.Tensor,
                        sin_table: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                        slots: torch.Tensor) -> None:
    """qkv [T, nh + 2 kvh, hd] (last dim contiguous): q and k rotated in place by the fp32 tables at
    `positions`, k and v written to kc, vc [kvh, slots, hd] at `slots` [T] (-1: skip the row)."""
    t, heads, hd = qkv.shape
    kvh = (heads - nh) // 2
    if t == 0:
        return
    half = hd // 2
    _rope_kv_write_kernel[(t,)](qkv, positions, cos_table, sin_table, kc, vc, slots, qkv.stride(0),
                                qkv.stride(1), kc.shape[1], NH=nh, KVH=kvh, N_PAD=_pow2(nh + kvh),
                                KVH_PAD=_pow2(kvh), HALF=half, HALF_PAD=_pow2(half))


def decode_splits(programs: int, width_tokens: int, device: torch.device) -> int:
    """Context splits per (sequence, kv head): enough programs to fill the device when a batch has few."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(16, sms // programs, triton.cdiv(width_tokens, 64)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, page: int, scale: float, out: torch.Tensor, splits: int | None = None,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [B, nh, hd] one token per sequence; tables [B, W] pages; lens [B] context incl. the token -> out.

    `splits` (default: `decode_splits`) divides each context among programs, merged by a combine kernel.
    `scales`: int8 pages' K and V scales, [kvh, pages] fp32 each."""
    b, nh, hd = q.shape
    kvh = kc.shape[0]
    group = nh // kvh
    d_pad = _pow2(hd, 16)
    if splits is None:
        splits = decode_splits(b * kvh, tables.shape[1] * page, q.device)
    part = ml = out
    if splits > 1:
        part = torch.empty((b, nh, splits, d_pad), dtype=torch.float32, device=q.device)
        ml = torch.empty((b, nh, splits, 2), dtype=torch.float32, device=q.device)
    ks, vs = scales if scales is not None else (kc, vc)
    # 128-position tiles for int8 pages and for head dims up to 64, 64 for wider bf16 heads: fastest on an
    # H100 (docs/gpu.md, decode-attention sweep)
    tile = max(128 if scales is not None or hd <= 64 else 64, page)
    _decode_kernel[(b, kvh, splits)](q, kc, vc, ks, vs, out, part, ml, tables, lens, scale, q.stride(0),
                                     q.stride(1), out.stride(0), out.stride(1), tables.stride(0), kc.shape[1],
                                     GROUP=group, G_PAD=_pow2(group, 16), D=hd, D_PAD=d_pad, PAGE=page,
                                     TILE=tile, SPLITS=splits, QUANT=scales is not None,
                                     **_precision(q.dtype))
    if splits > 1:
        _combine_kernel[(b, nh)](part, ml, out, out.stride(0), out.stride(1), NH=nh, D=hd, D_PAD=d_pad,
                                 SPLITS=splits, S_PAD=_pow2(splits))
    return out


def paged_prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                  q_start: torch.Tensor, q_len: torch.Tensor, ctx: torch.Tensor, max_q: int, page: int,
                  scale: float, out: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]
                  | None = None) -> torch.Tensor:
    """Chunks of q rows ([q_start, q_start + q_len) of q [T, nh, hd]) over their pages (context `ctx` each,
    the chunk's own K/V already written) -> the same rows of out. `scales` as in `paged_decode`."""
    nh, hd = q.shape[1], q.shape[2]
    kvh = kc.shape[0]
    block_m = 64 if max_q > 32 else (32 if max_q > 16 else 16)
    grid = (q_len.shape[0], nh, triton.cdiv(max_q, block_m))
    ks, vs = scales if scales is not None else (kc, vc)
    _prefill_kernel[grid](q, kc, vc, ks, vs, out, tables, q_start, q_len, ctx, scale, q.stride(0),
                          q.stride(1), out.stride(0), out.stride(1), tables.stride(0), kc.shape[1],
                          GROUP=nh // kvh, D=hd, D_PAD=_pow2(hd, 16), PAGE=page, BLOCK_M=block_m,
                          TILE=max(64, page), QUANT=scales is not None, **_precision(q.dtype))
    return out
