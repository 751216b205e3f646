"""GGUF block dequantization in torch for the types the shipped model uses (Q4_1, Q8_0): the same fp32
products and sums as gguf-py's numpy code, so the same bits, at a fraction of its time; every other type goes
to gguf-py."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 20] blocks (fp16 d, fp16 m, 16 bytes of nibbles) -> [n, 32]: d x q + m, low nibbles first."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    qs = blocks[:, 4:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=1).float()
    return (d * q).add_(m)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 34] blocks (fp16 d, 32 int8) -> [n, 32]: q x d."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


_TORCH = {GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q8_0: _q8_0}


def dequantize(raw: np.ndarray, qtype: int) -> torch.Tensor:
    """A tensor's raw GGUF data (rows of blocks as uint8, as the file holds them) -> fp32 of its logical
    shape."""
    kind = GGMLQuantizationType(qtype)
    fn = _TORCH.get(kind)
    if fn is None:
        return torch.from_numpy(np.require(gguf_dequantize(raw, kind), np.float32, ["C", "W"]))
    block, size = GGML_QUANT_SIZES[kind]
    shape = (*raw.shape[:-1], raw.shape[-1] // size * block)
    # off the read-only map
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(-1, size)
    return fn(blocks).view(shape)
