"""A page's K/V bytes out of the KV tensors into one compact host buffer, and back; the tier fingerprint."""

from __future__ import annotations

import torch
import xxhash

from worker.kvcache.tensors import KVCache
from worker.protocol import HASH_ALGO

FINGERPRINT_FORMAT = "fp2"  # fp1 named no weights: its tier directories are pruned, never read (`DiskTier`)


def fingerprint(model_id: str, weights_id: str, tokenizer_version: str, kv: KVCache) -> bytes:
    """16 bytes naming what a stored page's bytes mean: model, weights (their digest, quantization, dtype and
    version: `LoadedModel.weights_id`), tokenizer, KV dtype, dtype, layout and shape."""
    k = kv.k[0]
    text = "|".join((FINGERPRINT_FORMAT, model_id, weights_id, tokenizer_version, kv.kv_dtype, str(kv.dtype),
                     str(k.dtype), "pages_first" if kv.pages_first else "heads_first", f"L{len(kv.k)}",
                     "x".join(map(str, k.shape[
                         2:] if kv.pages_first else (k.shape[0], k.shape[2]))), f"bs{kv.block_size}",
                     HASH_ALGO))
    return xxhash.xxh3_128_digest(text.encode())


class PageCodec:
    """Copies whole pages between `kv` and compact uint8 rows: K of every layer, V, then the int8 scales."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        k = kv.k[0]
        self.layers = len(kv.k)
        self.page_shape = ((k.shape[1], k.shape[2], k.shape[3]) if kv.pages_first
                           else (k.shape[0], kv.block_size, k.shape[2]))
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
        """[len(pages), page_bytes] uint8 on the host: the pages' K, V and scales (one gather per layer)."""
        kv, n = self.kv, len(pages)
        idx = torch.tensor(pages, dtype=torch.int64, device=kv.k[0].device)
        out = torch.empty(n, self.page_bytes, dtype=torch.uint8)
        k, v, ks, vs = self._parts(out)
        for i in range(self.layers):
            for dst, src in ((k, kv.k[i]), (v, kv.v[i])):
                if kv.pages_first:
                    dst[:, i].copy_(src.index_select(0, idx))
                else:
                    dst[:, i].copy_(self._view(src).index_select(1, idx).transpose(0, 1))
            if kv.quantized:
                ks[:, i].copy_(kv.k_scale[i].index_select(1, idx).T)
                vs[:, i].copy_(kv.v_scale[i].index_select(1, idx).T)
        return out

    def _parts(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of [n, page_bytes] rows as K and V [n, L, *page_shape] and scales [n, L, kv_heads] (no
        copy)."""
        n, kb, sb = rows.shape[0], self.kv_bytes, self.scale_bytes
        shape = (n, self.layers, *self.page_shape)
        k = rows[:, :kb].view(self.store_dtype).view(shape)
        v = rows[:, kb: 2 * kb].view(self.store_dtype).view(shape)
        ks = rows[:, 2 * kb: 2 * kb + sb].view(torch.float32).view(n, self.layers, -1)
        vs = rows[:, 2 * kb + sb:].view(torch.float32).view(n, self.layers, -1)
        return k, v, ks, vs

    def finite(self, rows: torch.Tensor) -> bool:
        """Rows from another process hold only finite numbers: K and V (unless int8 codes) and the int8
        scales, which must also be positive (a NaN, inf or negative scale would poison every token that
        attends to the page)."""
        k, v, ks, vs = self._parts(rows)
        if self.store_dtype.is_floating_point and not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            return False
        if self.scale_bytes:
            return bool(torch.isfinite(ks).all() and torch.isfinite(vs).all() and (ks >= 0).all()
                        and (vs >= 0).all())
        return True

    def write(self, pages: list[int], rows: torch.Tensor) -> None:
        """Put rows from `read` (or the tiers) into `pages` of the KV tensors."""
        kv, n = self.kv, len(pages)
        assert rows.shape == (n, self.page_bytes), \
            f"rows {tuple(rows.shape)} for {n} pages of {self.page_bytes} B"
        dev = kv.k[0].device
        idx = torch.tensor(pages, dtype=torch.int64, device=dev)
        k, v, ks, vs = self._parts(rows.to(dev))
        for i in range(self.layers):
            if kv.pages_first:
                kv.k[i].index_copy_(0, idx, k[:, i])
                kv.v[i].index_copy_(0, idx, v[:, i])
            else:
                self._view(kv.k[i]).index_copy_(1, idx, k[:, i].transpose(0, 1))
                self._view(kv.v[i]).index_copy_(1, idx, v[:, i].transpose(0, 1))
            if kv.quantized:
                kv.k_scale[i].index_copy_(1, idx, ks[:, i].T.to(kv.k_scale[i].device))
                kv.v_scale[i].index_copy_(1, idx, vs[:, i].T.to(kv.v_scale[i].device))
