"""Which dtype KV pages get: `--kv-dtype` (`EngineConfig.kv_dtype`) resolved for the device and backend."""

from __future__ import annotations

import torch

from worker.config import EngineConfig


def resolve_kv_dtype(config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """("model" | "int8", why). An explicit int8 that cannot run here raises ValueError naming the flag.

    auto: the model dtype everywhere. int8 pages pass the perplexity gate (within 0.5% of the model dtype's,
    tests/worker/kvcache) and decode faster at long context on CPU (bench/kv_dtype.py), but they change the
    greedy answers users see: on the default model they keep a median 12.5 of 48 greedy tokens identical to
    fp32 where transformers' bf16 keeps 30.5 (bench/greedy_agreement.py, Intel Xeon with AMX). int8 is asked
    for explicitly (CPU: the C++ kernels; CUDA: the triton backend; elsewhere the pure-torch path, slow)."""
    from worker.model.backends import choose_backend

    asked = config.kv_dtype
    if asked != "int8":
        return "model", "asked" if asked == "model" else "auto: 8-bit pages change greedy answers"
    if choose_backend(config.attention_backend, device, config.block_size) == "flash_attn":
        raise ValueError("--kv-dtype int8 does not run with the flash_attn backend (its paged layout has no "
                         "int8 pages); use --kv-dtype model or auto, or --attention triton")
    return "int8", "asked"
