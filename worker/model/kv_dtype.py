"""Which dtype KV pages get: `--kv-dtype` (`EngineConfig.kv_dtype`) resolved for the device and backend."""

from __future__ import annotations

import torch

from worker.config import EngineConfig


def resolve_kv_dtype(config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """("model" | "int8", why). An explicit int8 that cannot run here raises ValueError naming the flag.

    auto: int8 on CPU where the C++ attention kernels run (the torch backend with its extension built): there
    it passed the quality gate (perplexity within 0.5% of the model dtype's, tests/worker/kvcache) and its
    decode step at 2k context took 0.5-0.6x the model dtype's (bench/kv_dtype.py, docs/engine.md); the model
    dtype elsewhere (the triton backend reads int8 pages when asked; on an H100 they were faster only for
    large models at long context; flash-attn has none; the pure-torch path dequantizes every gather)."""
    from worker.model.backends import choose_backend

    asked = config.kv_dtype
    if asked == "model":
        return "model", "asked"
    backend = choose_backend(config.attention_backend, device, config.block_size)
    if backend == "flash_attn":
        if asked == "int8":
            raise ValueError("--kv-dtype int8 does not run with the flash_attn backend (its paged layout has "
                             "no "
                             "int8 pages); use --kv-dtype model or auto, or --attention triton")
        return "model", "flash_attn has no int8 pages"
    if asked == "int8":  # triton's kernels, the C++ ones on CPU, else the pure-torch path (slow)
        return "int8", "asked"
    if backend == "triton":
        return "model", "triton: int8 pages were faster only for large models at long context (docs/gpu.md)"
    if device.type != "cpu" or backend == "torch_reference":
        return "model", f"no int8 KV kernels for {device.type} / {backend}"
    from worker.kernels.cpu import extension

    if extension() is None:
        return "model", "the C++ kernels are unavailable"
    return "int8", "CPU with the C++ int8 kernels"
