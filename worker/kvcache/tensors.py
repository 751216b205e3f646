"""The paged KV cache tensors and their sizing (page accounting is `page_pool.PagePool`).

Heads outermost, so gathering a batch's pages gives [kv_heads, batch, context, head_dim] for batched matmuls.
"""

from __future__ import annotations

import torch

from worker.config import EngineConfig, ModelConfig


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


def num_pages_for(cfg: ModelConfig, ecfg: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Pages that fit the byte budget (CPU) or the free device memory fraction (GPU)."""
    per_page = bytes_per_token(cfg, dtype) * ecfg.block_size
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
                 device: torch.device, pages_first: bool = False) -> None:
        self.num_pages = num_pages
        self.block_size = block_size
        self.num_slots = num_pages * block_size
        self.pages_first = pages_first
        if pages_first:  # flash-attn's paged layout
            shape = (num_pages, block_size, cfg.num_kv_heads, cfg.head_dim)
        else:
            shape = (cfg.num_kv_heads, self.num_slots, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
