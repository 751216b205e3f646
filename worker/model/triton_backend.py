"""The Triton attention backend: `prepare` turns a step's layout into int32 tables, `forward` runs the
kernels.

Kernels are in `worker.kernels.triton_attention`; a decode-only meta with fixed-size tensors is what CUDA
graphs replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.kernels.layer_ops import Rope
from worker.kvcache.tensors import KVCache
from worker.model.attention import BatchLayout, padded_table


@dataclass(slots=True)
class TritonMeta:
    slot_mapping: torch.Tensor  # [T] int64 (-1: a padded row that writes nothing)
    num_decode: int
    decode_tables: torch.Tensor | None = None  # [B, W] int32
    decode_lens: torch.Tensor | None = None  # [B] int32: context incl. the new token (0: a padded row)
    prefill_tables: torch.Tensor | None = None  # [C, W] int32
    q_start: torch.Tensor | None = None  # [C] int32: first row of each chunk among the prefill rows
    q_len: torch.Tensor | None = None  # [C] int32
    ctx_len: torch.Tensor | None = None  # [C] int32: context after the chunk
    max_q: int = 0


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    return padded_table(rows, torch.int32).to(device, non_blocking=True)


def _ints(xs: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)


class TritonAttention:
    """Paged decode, prefill/extend and the K/V write as Triton kernels over the worker's cache layout."""

    name = "triton"
    pages_first = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from worker.kernels import (  # import triton: only when this backend is chosen
            triton_attention as triton_kernels,
        )
        from worker.kernels.triton_kv_int8 import paged_kv_write_int8

        self.k = triton_kernels
        self.int8_write = paged_kv_write_int8
        self.nh, self.kvh, self.hd = num_heads, num_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def prepare(self, lay: BatchLayout, device: torch.device) -> TritonMeta:
        meta = TritonMeta(lay.slot_mapping, lay.num_decode)
        if lay.decode_ctx:
            meta.decode_tables = _table(lay.decode_tables, device)
            meta.decode_lens = _ints(lay.decode_ctx, device)
        if lay.prefill_q:
            starts, row = [], 0
            for n in lay.prefill_q:
                starts.append(row)
                row += n
            meta.prefill_tables = _table(lay.prefill_tables, device)
            meta.q_start, meta.q_len = _ints(starts, device), _ints(lay.prefill_q, device)
            meta.ctx_len, meta.max_q = _ints(lay.prefill_ctx, device), max(lay.prefill_q)
        return meta

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVCache, meta: TritonMeta) -> torch.Tensor:
        """q: [T, nh, hd]; k, v: [T, kvh, hd] -> [T, nh * hd]."""
        kc, vc = kv.k[layer], kv.v[layer]
        if kv.quantized:  # int8 pages: the write quantizes, the attention kernels read the codes and scales
            self.int8_write(k, v, kc, vc, kv.k_scale[layer], kv.v_scale[layer], meta.slot_mapping,
                            kv.block_size)
        else:
            self.k.paged_kv_write(k, v, kc, vc, meta.slot_mapping)
        return self.attend(layer, q, kv, meta)

    def forward_rope(self, layer: int, qkv: torch.Tensor, rope: Rope, kv: KVCache,
                     meta: TritonMeta) -> torch.Tensor:
        """qkv [T, nh + 2 kvh, hd] before RoPE, on model-dtype pages: the rotation and the K/V write in one
        kernel (`TritonOps.attend` calls this), then attention -> [T, nh * hd]."""
        self.k.paged_rope_kv_write(qkv, self.nh, rope.positions, rope.cos_table, rope.sin_table, kv.k[layer],
                                   kv.v[layer], meta.slot_mapping)
        return self.attend(layer, qkv[:, :self.nh], kv, meta)

    def attend(self, layer: int, q: torch.Tensor, kv: KVCache, meta: TritonMeta) -> torch.Tensor:
        """q [T, nh, hd] over the pages (this step's K/V already written) -> [T, nh * hd]."""
        kc, vc = kv.k[layer], kv.v[layer]
        scales = (kv.k_scale[layer], kv.v_scale[layer]) if kv.quantized else None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        b = meta.num_decode
        if b:
            self.k.paged_decode(q[:b], kc, vc, meta.decode_tables, meta.decode_lens, kv.block_size,
                                self.scale, out[:b], scales=scales)
        if meta.q_len is not None:
            self.k.paged_prefill(q[b:], kc, vc, meta.prefill_tables, meta.q_start, meta.q_len, meta.ctx_len,
                                 meta.max_q, kv.block_size, self.scale, out[b:], scales=scales)
        return out.view(q.shape[0], -1)
