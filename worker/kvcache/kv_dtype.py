"""Which dtype the KV pages get: `--kv-dtype` (`EngineConfig.kv_dtype`) resolved for the device and backend."""

from __future__ import annotations

import torch

from worker.config import EngineConfig


def resolve_kv_dtype(config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """("model" | "int8", why). An explicit int8 that cannot run here raises ValueError naming the flag.

    auto: int8 on CPU where the C++ attention kernels run (the torch backend with its extension built): there it
    passed the quality gate (perplexity within 0.5% of the model dtype's, tests/worker/kvcache) and its decode
    step at 2k context took 0.5-0.6x the model dtype's (bench/kv_dtype.py, docs/engine.md); the model dtype
    elsewhere (the triton backend reads int8 pages when asked; flash-attn has none; the torch reference would
    dequantize every gather)."""
    from worker.model.backends import choose_backend

    asked = config.kv_dtype
    if asked == "model":
        return "model", "asked"
    backend = choose_backend(config.attention_backend, device, config.block_size)
    if backend == "triton":  # its kernels read int8 pages (worker/kernels/triton_kv_int8.py)
        if asked == "int8":
            return "int8", "asked"
        return "model", "triton: int8 pages halve the KV bytes, but auto keeps the model dtype (docs/gpu.md)"
    if device.type != "cpu" or backend not in ("torch", "torch_reference"):
        if asked == "int8":
            raise ValueError(f"--kv-dtype int8 runs with the torch attention backend on CPU or the triton backend "
                             f"(device {device}, backend {backend}); use --kv-dtype model or auto")
        return "model", f"no int8 KV kernels for {device.type} / {backend}"
    if asked == "int8":
        return "int8", "asked"
    if backend != "torch":
        return "model", "the torch_reference backend (no C++ kernels)"
    from worker.kernels.cpu import extension

    if extension() is None:
        return "model", "the C++ kernels are unavailable"
    return "int8", "CPU with the C++ int8 kernels"
