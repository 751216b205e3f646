"""bf16 linear layers with weights prepacked once into oneDNN's blocked layout (CPU).

`F.linear` on a plain bf16 weight reorders it on every call; at decode sizes that reorder costs as much
as the product itself. The packed product is bit-identical to `F.linear` over the same rows; above 16 rows
they are padded to a bounded set of counts (tests/worker/quant/test_packed_linear.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker.quant.onednn_int8 import padded_rows

__all__ = ["PackedLinear", "can_pack", "pack", "pack_model", "packed_linear"]
log = logging.getLogger(__name__)
MAX_RESCORED = 64  # near-tied logits re-scored per row, on average (`PackedLinear.logits`)
# Row counts up to this run as they come (decode batches: one kernel each); above, rows are padded to
# `padded_rows`' buckets, as the int8 path does, so prefill and mixed steps reuse ~28 kernels per shape
# instead of JIT-compiling one per new step size and thrashing the worker's 256-kernel cache
# (`worker.server.process.memory`)
EXACT_ROWS = 16


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN bf16 packing is available for this dtype and device (fp32 stays plain: it is the reference)."""
    return (dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of a dense [out, in] bf16 weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x2: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x2 [rows, in] @ packed.T -> [rows, out]; above EXACT_ROWS over zero rows up to `padded_rows`, so oneDNN
    runs one of a bounded set of kernels (it JITs one per row count it has not seen: 2-5 ms each)."""
    rows = x2.shape[0]
    padded = rows if rows <= EXACT_ROWS else padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x2, packed, None, "none", [], "")
    buf = x2.new_empty(padded, x2.shape[1])
    buf[:rows] = x2
    buf[rows:] = 0
    return torch.ops.mkldnn._linear_pointwise(buf, packed, None, "none", [], "")[:rows]


class PackedLinear(nn.Module):
    """A bias-free linear layer over a prepacked weight; `weight` unpacks a dense copy on demand."""

    def __init__(self, weight: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack(weight)  # not a buffer: opaque tensors have no storage to save or copy
        # an LM head's plain weight, when it costs nothing to keep (tied to the embedding): `logits` re-scores
        # the near-ties its bf16 output makes in fp32
        self.rows = rows

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = packed_linear(x.reshape(-1, shape[-1]), self.packed)
        return y.reshape(*shape[:-1], self.out_features)

    def logits(self, x2: torch.Tensor) -> torch.Tensor:
        """fp32 logits of an LM head's [rows, in] input. The bf16 product rounds each logit by up to half an
        ulp, which turns near ties into exact ones (the tie then goes to the lower id); every logit within two
        ulps of its row's largest (2-4 ulps) is computed again from the bf16 weight row with an fp32 sum, so
        the leaders are ordered as the unrounded product orders them (a logit outside that window is below the
        true largest)."""
        y = packed_linear(x2, self.packed).float()
        if self.rows is None:
            return y
        top = y.amax(1, keepdim=True)
        near = (y >= top - top.abs() * 2.0 ** -6 - 1e-30).nonzero()  # 2-4 ulps of bf16 at the top
        if len(near) > MAX_RESCORED * len(y):
            return y  # a flat row (near-uniform logits): rounding matters to no decision there
        r, c = near[:, 0], near[:, 1]
        y[r, c] = (x2[r].float() * self.rows[c].float()).sum(1)
        return y

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        return PackedLinear(self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, packed=onednn"


def pack_model(model: nn.Module) -> int:
    """Swap every plain bf16 CPU `nn.Linear` (no bias) of the decoder and its LM head for a `PackedLinear`."""
    count = 0
    with torch.inference_mode(False), torch.no_grad():
        for parent in [*model.layers, model]:
            for name, child in list(parent.named_children()):
                if (type(child) is nn.Linear and child.bias is None
                        and can_pack(child.weight.dtype, child.weight.device)):
                    tied = parent is model and name == "lm_head" and child.weight is model.embed.weight
                    setattr(parent, name, PackedLinear(child.weight, child.weight if tied else None))
                    count += 1
    if count:
        log.info("prepacked %d linear layers for oneDNN (bf16)", count)
    return count
