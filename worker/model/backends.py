"""Which attention backend and which layer ops a runner gets, by device, dtype and what is installed.

`choose_backend` is the attention rule (docs/gpu.md); `make_ops` the fused-ops one.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from worker.kernels.layer_ops import KERNEL_DTYPES, EagerOps, FusedOps
from worker.model.attention import FlashAttention, Int8Kernels, TorchAttention
from worker.model.triton_backend import TritonAttention

log = logging.getLogger(__name__)


BACKENDS = ("auto", "triton", "flash_attn", "torch", "torch_reference")


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on CPU tensors under its interpreter (TRITON_INTERPRET=1, the tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def choose_backend(name: str, device: torch.device, block_size: int) -> str:
    """The backend `name` resolves to here; an explicit choice that cannot run raises, naming why.

    auto: flash-attn 2 on CUDA when installed and the page size fits it, else Triton on CUDA; on CPU torch
    (its C++ kernels)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "flash_attn" and not FlashAttention.usable(block_size):
        raise ValueError("attention 'flash_attn' needs CUDA, the flash-attn package and a block size that is "
                         "a "
                         f"multiple of 256 (block size {block_size})")
    if name == "triton" and not triton_usable(device):
        raise ValueError(f"attention 'triton' needs the triton package and a CUDA device (device {device})")
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    if FlashAttention.usable(block_size):
        return "flash_attn"
    return "triton" if triton_usable(device) else "torch"


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device):
    """The attention backend for `name` (see `choose_backend`), logged once."""
    chosen = choose_backend(name, device, block_size)
    log.info("attention backend %s (asked: %s, device %s, block size %d)", chosen, name, device, block_size)
    if chosen == "flash_attn":
        return FlashAttention(num_heads, num_kv_heads, head_dim)
    if chosen == "triton":
        return TritonAttention(num_heads, num_kv_heads, head_dim)
    kernel = prefill_kernel = kv_write = int8 = None
    if device.type == "cpu" and chosen != "torch_reference":
        from worker.kernels import cpu

        kernel = cpu.paged_decode_kernel()
        prefill_kernel = cpu.paged_prefill_kernel(num_heads, num_kv_heads, head_dim)
        kv_write = cpu.paged_kv_write_kernel()
        found = cpu.int8_kv_kernels(num_heads, num_kv_heads, head_dim)
        int8 = Int8Kernels(*found) if found is not None else None
    return TorchAttention(num_heads, num_kv_heads, head_dim, kernel, prefill_kernel, kv_write, int8)


def make_ops(fused: bool, device: torch.device, dtype: torch.dtype, fused_linear: bool = False) -> EagerOps:
    """Fused ops when asked for: Triton kernels on CUDA (`worker.kernels.triton_ops`; with `fused_linear`, the
    norms and SiLU·mul inside the projections too), the C++ passes on a CPU model in bf16 or fp32 with the
    extension built; EagerOps otherwise."""
    if not fused:
        return EagerOps()
    if device.type == "cuda":
        if not triton_usable(device):
            log.info("fused ops on CUDA need triton: eager ops")
            return EagerOps()
        from worker.kernels.triton_ops import TritonOps  # imports triton: only on CUDA

        return TritonOps(fused_linear=fused_linear)
    if device.type != "cpu" or dtype not in KERNEL_DTYPES:
        log.info("fused ops run on CUDA, or on CPU in bf16 or fp32: eager ops on %s, %s", device, dtype)
        return EagerOps()
    from worker.kernels.cpu import extension

    ext = extension()
    if ext is None:
        log.warning("fused ops asked for, but the C++ extension is unavailable: using the eager torch ops")
        return EagerOps()
    return FusedOps(ext)
