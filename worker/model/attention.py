"""Paged attention backends behind one interface: `prepare` per step, `forward` per layer.

`TorchAttention` is the reference and CPU path; on CUDA `FlashAttention` (flash-attn 2) where it fits, else
`worker.model.triton_backend.TritonAttention`. `worker.model.backends` picks one.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker.kernels import cascade
from worker.kvcache import quant
from worker.kvcache.tensors import KVCache


def padded_table(rows: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Per-sequence page lists as one host tensor [len(rows), longest], padded with page 0 (never read: every
    kernel stops at its sequence's context length)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=dtype)


@dataclass(slots=True)
class BatchLayout:
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every token of the step
    decode_tables: list[list[int]]  # per decode sequence: its pages
    decode_ctx: list[int]  # per decode sequence: context length incl. the new token
    prefill_tables: list[list[int]]
    prefill_q: list[int]  # tokens of the chunk
    prefill_ctx: list[int]  # context length after the chunk (cached prefix + earlier chunks + chunk)

    @property
    def num_decode(self) -> int:
        return len(self.decode_ctx)


@dataclass(slots=True)
class Int8Kernels:
    """The C++ kernels over int8 KV pages (`csrc/kv_int8.cpp`, `worker.kernels.cpu.int8_kernels`)."""

    decode: object  # paged_decode_int8(q, kc, vc, ks, vs, tables, lens, bs, scale)
    # paged_prefill_int8(q, kc, vc, ks, vs, tables, q_lens, ctx_lens, bs, scale), None: shape
    prefill: object | None
    write: object  # paged_kv_write_int8(k, v, kc, vc, ks, vs, slot_mapping, bs, grow)


@dataclass(slots=True)
class _Chunk:
    start: int  # first token row in the step
    q_len: int
    ctx_slots: torch.Tensor | None  # None => fresh prompt: attend to the chunk itself, causal
    mask: torch.Tensor | None  # [q, ctx] bool, True = may attend


@dataclass(slots=True)
class TorchMeta:
    slot_mapping: torch.Tensor
    num_decode: int
    decode_pages: torch.Tensor | None  # [B * max_pages] flattened page ids
    decode_mask: torch.Tensor | None  # [B, 1, L] additive float mask
    decode_len: int
    chunks: list[_Chunk]
    decode_tables: torch.Tensor | None = None  # [B, max_pages] int64 (C++ kernel path)
    decode_lens: torch.Tensor | None = None  # [B] int64 (C++ kernel path)
    # tables, q_lens, ctx_lens (C++ path)
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    cascades: list[cascade.CascadeGroup] = field(default_factory=list)  # SDPA path: chunks sharing a prefix


class TorchAttention:
    """Paged attention on torch tensors: the C++ CPU kernels where given (`worker.kernels.cpu`), else the
    pure-torch reference (batched gather + matmuls for decode, SDPA per prefill chunk). An int8 cache
    (`KVCache.quantized`) takes the `int8` kernels where the model-dtype ones are given, else the reference on
    dequantized gathers."""

    name = "torch"
    pages_first = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernel=None, prefill_kernel=None,
                 kv_write=None, int8: Int8Kernels | None = None) -> None:
        self.nh, self.kvh, self.hd = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        self.kernel = kernel  # cpu_kernels.paged_decode or None
        self.prefill_kernel = prefill_kernel  # cpu_kernels.paged_prefill or None
        self.kv_write = kv_write  # cpu_kernels.paged_kv_write (one call for a layer's new K/V rows) or None
        self.int8 = int8  # the same kernels over int8 pages: used for what the model-dtype ones are given
        # "kernel": prefill chunks on the C++ kernel; "sdpa": torch's SDPA per chunk
        # (`worker.model.prefill_choice`)
        self.prefill_path = "kernel" if prefill_kernel is not None else "sdpa"

    def prepare(self, lay: BatchLayout, device: torch.device) -> TorchMeta:
        bs = lay.block_size
        pages = mask = tables = lens = None
        length = 0
        if lay.decode_ctx and self.kernel is not None:
            tables = padded_table(lay.decode_tables, torch.int64)
            lens = torch.tensor(lay.decode_ctx, dtype=torch.int64)
        elif lay.decode_ctx:
            padded = padded_table(lay.decode_tables, torch.int64)
            pages = padded.view(-1).to(device, non_blocking=True)
            length = padded.shape[1] * bs
            ctx = torch.tensor(lay.decode_ctx, dtype=torch.int64)
            beyond = torch.arange(length)[None, :] >= ctx[:, None]
            mask = torch.zeros(beyond.shape, dtype=torch.float32).masked_fill_(beyond, float("-inf"))
            mask = mask[:, None, :].to(device, non_blocking=True)
        if lay.prefill_q and self.prefill_kernel is not None:
            prefill = (padded_table(lay.prefill_tables, torch.int64),
                       torch.tensor(lay.prefill_q, dtype=torch.int64),
                       torch.tensor(lay.prefill_ctx, dtype=torch.int64))
            return TorchMeta(lay.slot_mapping, lay.num_decode, pages, mask, length, [], tables, lens, prefill)
        starts = _cumsum([lay.num_decode, *lay.prefill_q])[:-1]
        groups, taken = [], set()
        if cascade.available(device):
            groups, taken = cascade.plan(lay.prefill_tables, lay.prefill_q, lay.prefill_ctx, starts, bs)
        chunks = []
        for i, (table, q_len, ctx_len) in enumerate(zip(lay.prefill_tables, lay.prefill_q, lay.prefill_ctx,
                                                        strict=True)):
            if i in taken:
                continue
            ctx_slots = cmask = None
            if ctx_len != q_len:
                ctx_slots = cascade.token_slots(table, 0, ctx_len, bs).to(device)
                cmask = cascade.visible(ctx_len - q_len, q_len, 0, ctx_len).to(device)
            chunks.append(_Chunk(starts[i], q_len, ctx_slots, cmask))
        return TorchMeta(lay.slot_mapping, lay.num_decode, pages, mask, length, chunks, tables, lens,
                         cascades=groups)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVCache, meta: TorchMeta) -> torch.Tensor:
        """q: [T, nh, hd]; k, v: [T, kvh, hd] -> [T, nh * hd]."""
        if kv.quantized:
            return self._forward_int8(layer, q, k, v, kv, meta)
        kc, vc = kv.k[layer], kv.v[layer]
        if self.kv_write is not None:
            self.kv_write(k, v, kc, vc, meta.slot_mapping)
        else:
            kc.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            vc.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        b = meta.num_decode
        if b == q.shape[0]:  # a decode-only step: the decode output is the whole result
            return self._decode(q, kc, vc, kv.block_size, meta).reshape(b, -1)
        out = torch.empty_like(q)
        if b:
            out[:b] = self._decode(q[:b], kc, vc, kv.block_size, meta)
        if meta.prefill is not None:
            out[b:] = self.prefill_kernel(q[b:].contiguous(), kc, vc, *meta.prefill, kv.block_size,
                                          self.scale)
        for ch in meta.chunks:
            rows = slice(ch.start, ch.start + ch.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kc, vc, ch)
        for group in meta.cascades:
            out.index_copy_(0, group.rows, cascade.attend(group, q, lambda s: kc.index_select(1, s),
                                                          lambda s: vc.index_select(1, s), self.scale))
        return out.view(q.shape[0], -1)

    def _forward_int8(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                      meta: TorchMeta) -> torch.Tensor:
        """`forward` over int8 pages: every read, a fresh prompt's own rows included, sees the quantized
        K/V."""
        kc, vc, ks, vs, bs = kv.k[layer], kv.v[layer], kv.k_scale[layer], kv.v_scale[layer], kv.block_size
        if (meta.decode_tables is not None or meta.prefill is not None) and self.int8 is None:
            raise ValueError("an int8 KV cache with the C++ attention kernels needs their int8 versions")
        if self.int8 is not None:
            self.int8.write(k, v, kc, vc, ks, vs, meta.slot_mapping, bs, quant.GROW)
        else:
            quant.write_int8(k, kc, ks, meta.slot_mapping, bs)
            quant.write_int8(v, vc, vs, meta.slot_mapping, bs)
        b, out = meta.num_decode, torch.empty_like(q)
        if b and meta.decode_tables is not None:
            out[:b] = self.int8.decode(q[:b], kc, vc, ks, vs, meta.decode_tables, meta.decode_lens, bs,
                                       self.scale)
        elif b:
            slots = cascade.page_slots(meta.decode_pages, bs)
            shape = (self.kvh, b, meta.decode_len, self.hd)
            out[:b] = self._decode_gathered(q[:b],
                                            quant.dequantize_slots(kc, ks, slots, bs, q.dtype).view(shape),
                                            quant.dequantize_slots(vc, vs, slots, bs, q.dtype).view(shape),
                                            meta)
        if meta.prefill is not None:
            out[b:] = self.int8.prefill(q[b:].contiguous(), kc, vc, ks, vs, *meta.prefill, bs, self.scale)
        for ch in meta.chunks:
            rows = slice(ch.start, ch.start + ch.q_len)
            slots = meta.slot_mapping[rows] if ch.ctx_slots is None else ch.ctx_slots
            kh = quant.dequantize_slots(kc, ks, slots, bs, q.dtype)
            vh = quant.dequantize_slots(vc, vs, slots, bs, q.dtype)
            out[rows] = self._sdpa(q[rows], kh, vh, ch.mask)
        for group in meta.cascades:
            out.index_copy_(0, group.rows, cascade.attend(
                group, q, lambda s: quant.dequantize_slots(kc, ks, s, bs, q.dtype),
                lambda s: quant.dequantize_slots(vc, vs, s, bs, q.dtype), self.scale))
        return out.view(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bs: int,
                meta: TorchMeta) -> torch.Tensor:
        if meta.decode_tables is not None:
            return self.kernel(q, kc, vc, meta.decode_tables, meta.decode_lens, bs, self.scale)
        b, kvh, hd, length = q.shape[0], self.kvh, self.hd, meta.decode_len
        keys = kc.view(kvh, -1, bs * hd).index_select(1, meta.decode_pages).view(kvh, b, length, hd)
        vals = vc.view(kvh, -1, bs * hd).index_select(1, meta.decode_pages).view(kvh, b, length, hd)
        return self._decode_gathered(q, keys, vals, meta)

    def _decode_gathered(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                         meta: TorchMeta) -> torch.Tensor:
        """keys, vals [kvh, B, L, hd]: the decode rows' padded contexts."""
        b, kvh, hd = q.shape[0], self.kvh, self.hd
        qg = q.view(b, kvh, self.group, hd).transpose(0, 1)  # [kvh, B, g, hd]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float()
        scores.mul_(self.scale).add_(meta.decode_mask)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, vals)  # [kvh, B, g, hd]
        return o.transpose(0, 1).reshape(b, self.nh, hd)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor,
                 vc: torch.Tensor, ch: _Chunk) -> torch.Tensor:
        if ch.ctx_slots is None:
            return self._sdpa(q, k.transpose(0, 1), v.transpose(0, 1), None)
        past = ch.ctx_slots.shape[0] - ch.q_len
        if past > 0 and ch.q_len >= cascade.SPLIT_MIN_Q and cascade.available(q.device):
            prefix = ch.ctx_slots[:past]
            return cascade.after_prefix(q, kc.index_select(1, prefix), vc.index_select(1, prefix),
                                        k.transpose(0, 1), v.transpose(0, 1), self.scale)
        return self._sdpa(q, kc.index_select(1, ch.ctx_slots), vc.index_select(1, ch.ctx_slots), ch.mask)

    def _sdpa(self, q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """q [n, nh, hd] against kh, vh [kvh, ctx, hd]; mask None: causal over the chunk itself."""
        qh = q.transpose(0, 1)[None]  # [1, nh, q, hd]
        o = F.scaled_dot_product_attention(qh, kh[None], vh[None], attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)


@dataclass(slots=True)
class FlashMeta:
    slot_mapping: torch.Tensor
    num_decode: int
    decode_table: torch.Tensor | None  # [B, max_pages] int32
    decode_lens: torch.Tensor | None  # [B] int32
    prefill_table: torch.Tensor | None
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    max_q: int
    max_k: int


class FlashAttention:
    """flash-attn 2: varlen prefill (with the cached prefix through block_table) and paged decode."""

    name = "flash_attn"
    pages_first = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        import flash_attn  # noqa: F401 - fail early when missing

        self.nh, self.kvh, self.hd = num_heads, num_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    @staticmethod
    def usable(block_size: int) -> bool:
        if not torch.cuda.is_available() or block_size % 256:
            return False  # flash-attn 2 paged kernels need pages of a multiple of 256 tokens
        return importlib.util.find_spec("flash_attn") is not None

    def prepare(self, lay: BatchLayout, device: torch.device) -> FlashMeta:
        def table(rows: list[list[int]]) -> torch.Tensor:
            return padded_table(rows, torch.int32).to(device)

        dt = dl = pt = cu_q = cu_k = None
        if lay.decode_ctx:
            dt = table(lay.decode_tables)
            dl = torch.tensor(lay.decode_ctx, dtype=torch.int32).to(device)
        if lay.prefill_q:
            pt = table(lay.prefill_tables)
            cu_q = torch.tensor([0, *_cumsum(lay.prefill_q)], dtype=torch.int32).to(device)
            cu_k = torch.tensor([0, *_cumsum(lay.prefill_ctx)], dtype=torch.int32).to(device)
        return FlashMeta(lay.slot_mapping, lay.num_decode, dt, dl, pt, cu_q, cu_k,
                         max(lay.prefill_q, default=0), max(lay.prefill_ctx, default=0))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVCache, meta: FlashMeta) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        kc, vc = kv.k[layer], kv.v[layer]
        kc.view(-1, self.kvh, self.hd).index_copy_(0, meta.slot_mapping, k)
        vc.view(-1, self.kvh, self.hd).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        b = meta.num_decode
        if b:
            o = flash_attn_with_kvcache(q[:b, None], kc, vc, cache_seqlens=meta.decode_lens,
                                        block_table=meta.decode_table, softmax_scale=self.scale, causal=True)
            out[:b] = o[:, 0]
        if meta.cu_q is not None:
            out[b:] = flash_attn_varlen_func(q[b:], kc, vc, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k,
                                             softmax_scale=self.scale, causal=True,
                                             block_table=meta.prefill_table)
        return out.view(q.shape[0], -1)


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out
