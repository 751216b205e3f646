"""The paged KV cache tensors and their sizing (page accounting is `page_pool.PagePool`).

Heads outermost, so gathering a batch's pages gives [kv_heads, batch, context, head_dim] for batched matmuls.
With `kv_dtype="int8"` K and V are int8 with one fp32 scale per (kv head, page) each (`worker.kvcache.quant`).
"""

from __future__ import annotations

import torch

from worker.config import EngineConfig, ModelConfig

KV_DTYPES = ("model", "int8")  # what `worker.model.kv_dtype.resolve_kv_dtype` resolves "auto" to


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V bytes of one token over all layers in the model's dtype."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


def bytes_per_page(cfg: ModelConfig, dtype: torch.dtype, block_size: int, kv_dtype: str = "model") -> int:
    """K and V bytes of one page over all layers; int8 counts its two fp32 scales per layer and kv head."""
    if kv_dtype == "int8":
        return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * block_size + 4)
    return bytes_per_token(cfg, dtype) * block_size


def num_pages_for(cfg: ModelConfig, ecfg: EngineConfig, dtype: torch.dtype, device: torch.device,
                  kv_dtype: str = "model") -> int:
    """Pages that fit the byte budget (CPU) or the free device memory fraction (GPU)."""
    per_page = bytes_per_page(cfg, dtype, ecfg.block_size, kv_dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_elsewhere = total - free
        budget = int(total * ecfg.gpu_memory_fraction) - used_elsewhere
        # leave room for activations of one full step and the CUDA graphs
        budget -= 512 << 20
        if ecfg.kv_cache_bytes is not None:
            budget = min(budget, ecfg.kv_cache_bytes)
    else:
        budget = ecfg.kv_cache_bytes if ecfg.kv_cache_bytes is not None else ecfg.default_cpu_kv_bytes
    pages = budget // per_page
    if pages < 1:
        raise ValueError(f"KV budget of {budget} bytes holds no page of {per_page} bytes")
    return int(pages)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, pages_first: bool = False, kv_dtype: str = "model") -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype {kv_dtype!r} is not one of {KV_DTYPES}")
        if kv_dtype == "int8" and pages_first:
            raise ValueError("--kv-dtype int8 runs with the torch (CPU) or triton attention backends")
        self.num_pages = num_pages
        self.block_size = block_size
        self.num_slots = num_pages * block_size
        self.pages_first = pages_first
        self.kv_dtype = kv_dtype
        self.dtype = dtype  # the model's: attention reads and writes K/V in it
        if pages_first:  # flash-attn's paged layout
            shape = (num_pages, block_size, cfg.num_kv_heads, cfg.head_dim)
        else:
            shape = (cfg.num_kv_heads, self.num_slots, cfg.head_dim)
        store = torch.int8 if kv_dtype == "int8" else dtype
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(cfg.num_layers)]
        # int8: per layer, [kv_heads, pages] fp32 scales of K and of V; empty otherwise
        scale_shape = (cfg.num_kv_heads, num_pages)
        self.k_scale = [torch.zeros(scale_shape, device=device) for _ in self.k] if kv_dtype == "int8" else []
        self.v_scale = [torch.zeros(scale_shape, device=device) for _ in self.v] if kv_dtype == "int8" else []

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "int8"
