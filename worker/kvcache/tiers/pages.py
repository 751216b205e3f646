"""A page's K/V bytes out of the KV tensors into one compact host buffer, and back; the tier fingerprint."""

from __future__ import annotations

import torch
import xxhash

from worker.kvcache.tensors import KVCache
from worker.protocol import HASH_ALGO


def fingerprint(model_id: str, tokenizer_version: str, kv: KVCache) -> bytes:
    """16 bytes naming what a stored page's bytes mean: model, tokenizer, KV dtype, dtype, layout and shape."""
    k = kv.k[0]
    text = "|".join((model_id, tokenizer_version, kv.kv_dtype, str(kv.dtype), str(k.dtype),
                     "pages_first" if kv.pages_first else "heads_first", f"L{len(kv.k)}", "x".join(map(str, k.shape[
                         2:] if kv.pages_first else (k.shape[0], k.shape[2]))), f"bs{kv.block_size}", HASH_ALGO))
    return xxhash.xxh3_128_digest(text.encode())


class PageCodec:
    """Copies whole pages between `kv` and compact uint8 rows: K of every layer, V, then the int8 scales."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        k = kv.k[0]
        self.layers = len(kv.k)
        self.page_shape = (k.shape[1], k.shape[2], k.shape[3]) if kv.pages_first else (k.shape[0], kv.block_size,
                                                                                           k.shape[2])
        self.store_dtype = k.dtype
        elems = self.page_shape[0] * self.page_shape[1] * self.page_shape[2]
        self.kv_bytes = self.layers * elems * k.element_size()  # K (or V) of one page over all layers
        self.scale_bytes = self.layers * kv.k_scale[0].shape[0] * 4 if kv.quantized else 0  # fp32 per kv head
        self.page_bytes = 2 * self.kv_bytes + 2 * self.scale_bytes

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        """One layer's cache as [pages, ...] (pages_first) or [kv_heads, pages, bs, hd]."""
        if self.kv.pages_first:
            return t
        return t.view(t.shape[0], -1, self.kv.block_size, t.shape[2])

    def read(self, pages: list[int]) -> torch.Tensor:
        """[len(pages), page_bytes] uint8 on the host: the pages' K, V and scales."""
        kv = self.kv
        idx = torch.tensor(pages, dtype=torch.int64, device=kv.k[0].device)
        n = len(pages)
        parts = [self._gather(kv.k, idx).reshape(n, -1), self._gather(kv.v, idx).reshape(n, -1)]
        if kv.quantized:
            for scales in (kv.k_scale, kv.v_scale):  # per layer [kv_heads, pages]
                parts.append(torch.stack([s[:, idx] for s in scales], 1).permute(2, 1, 0).contiguous()
                             .view(torch.uint8).reshape(n, -1))
        return torch.cat([p.cpu() for p in parts], 1)

    def _gather(self, layers: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        if self.kv.pages_first:
            rows = torch.stack([t[idx] for t in layers], 1)  # [n, L, bs, kvh, hd]
        else:
            rows = torch.stack([self._view(t)[:, idx] for t in layers], 0).permute(2, 0, 1, 3, 4)  # [n, L, kvh, bs, hd]
        return rows.contiguous().view(torch.uint8)

    def write(self, pages: list[int], rows: torch.Tensor) -> None:
        """Put rows from `read` (or the tiers) into `pages` of the KV tensors."""
        kv, n = self.kv, len(pages)
        assert rows.shape == (n, self.page_bytes), f"rows {tuple(rows.shape)} for {n} pages of {self.page_bytes} B"
        dev = kv.k[0].device
        idx = torch.tensor(pages, dtype=torch.int64, device=dev)
        rows = rows.to(dev)
        kb, sb = self.kv_bytes, self.scale_bytes
        shape = (n, self.layers, *self.page_shape)
        k = rows[:, :kb].contiguous().view(self.store_dtype).view(shape)
        v = rows[:, kb: 2 * kb].contiguous().view(self.store_dtype).view(shape)
        for i in range(self.layers):
            if kv.pages_first:
                kv.k[i][idx] = k[:, i]
                kv.v[i][idx] = v[:, i]
            else:
                self._view(kv.k[i])[:, idx] = k[:, i].transpose(0, 1)
                self._view(kv.v[i])[:, idx] = v[:, i].transpose(0, 1)
        if kv.quantized:
            ks = rows[:, 2 * kb: 2 * kb + sb].contiguous().view(torch.float32).view(n, self.layers, -1)
            vs = rows[:, 2 * kb + sb:].contiguous().view(torch.float32).view(n, self.layers, -1)
            for i in range(self.layers):
                kv.k_scale[i][:, idx] = ks[:, i].T.to(kv.k_scale[i].device)
                kv.v_scale[i][:, idx] = vs[:, i].T.to(kv.v_scale[i].device)
