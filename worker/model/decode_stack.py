"""A decode-only step's decoder layers in one C++ call on CPU (`csrc/decode_stack.cpp`): the kernels the
Python layer loop would call, in its order, so the outputs are the same bits without ~25 Python-dispatched
calls a layer.

Used where every piece has a C++ kernel: fused ops, the C++ paged decode attention (int8 or model-dtype pages)
and quantized or oneDNN-packed bf16 linears whose path at the step's row count is a kernel
(`linear_kind`); any other step runs the loop.
"""

from __future__ import annotations

import torch

from worker.config import LAYER_LINEARS
from worker.kernels.cpu_features import has_int8_dot
from worker.kernels.layer_ops import FusedOps
from worker.kvcache import quant
from worker.kvcache.tensors import KVCache
from worker.model.attention import TorchAttention, TorchMeta
from worker.quant.packed import EXACT_ROWS, PackedLinear
from worker.quant.weights import QuantLinear

__all__ = ["DecodeStack", "linear_kind"]

# csrc/decode_stack.cpp's `stack::Kind`
VNNI, AVX2, WEIGHT_ONLY, INT_MM, A16, A16_VNNI, PACKED = 0, 1, 2, 3, 4, 5, 6
MAX_PLANS = 256  # row counts remembered (a step has at most max_num_seqs decode rows)


def linear_kind(lin: object, rows: int) -> tuple[int, list[torch.Tensor]] | None:
    """How `QuantLinear.forward` or `PackedLinear.forward` runs `rows` rows of `lin`, as a kind and its
    tensors; None where it is not one of the C++ stack's kernels (a plain dense or int4 product, a padded
    packed one, or another module)."""
    if isinstance(lin, PackedLinear):
        return (PACKED, [lin.packed]) if rows <= EXACT_ROWS else None
    if not isinstance(lin, QuantLinear):
        return None
    if rows <= lin.max_rows:
        if lin.a16 is not None and lin.a16.kind == "vnni":
            return A16_VNNI, [lin.a16.packed, lin.a16.colsum, lin.a16.col_scale]
        if lin.a16 is not None:
            return A16, [lin.a16.packed, lin.a16.col_scale]
        if lin.mode == "int4" or lin.qweight is None:
            return None
        return WEIGHT_ONLY, [lin.qweight, lin.kernel_scales]
    w = lin.w8a8
    if w is None:
        return None
    if w.small is not None and rows <= w.small_rows:
        packed, colsum = w.small
        if w.small_kind == "vnni":
            return VNNI, [w.inv_smooth, packed, colsum, w.col_scale]
        return AVX2, [w.inv_smooth, packed, w.col_scale]
    # oneDNN's product (AMX) was measured faster than `_int_mm`: the Python path runs it
    if w.onednn is not None:
        return None
    return (INT_MM, [w.inv_smooth, w.wt, w.col_scale]) if has_int8_dot() else None


class DecodeStack:
    """The C++ decode stack of one model and KV cache; `build` says whether this runner can use it at all."""

    def __init__(self, model: torch.nn.Module, attn: TorchAttention, kv: KVCache, ext) -> None:
        self.model, self.attn, self.kv, self.ext = model, attn, kv, ext
        self.eps = float(model.cfg.rms_norm_eps)
        self._plans: dict[int, tuple[list[torch.Tensor], list[int]] | None] = {}

    @classmethod
    def build(cls, model: torch.nn.Module, attn: object, kv: KVCache, ops: object) -> DecodeStack | None:
        if (not isinstance(ops, FusedOps) or not isinstance(attn, TorchAttention)
                or kv.k[0].device.type != "cpu"):
            return None
        if not hasattr(ops.ext, "decode_stack") or not hasattr(model, "layers"):
            return None
        kernels = (attn.int8 is not None if kv.quantized
                   else attn.kernel is not None and attn.kv_write is not None)
        if not kernels:
            return None
        return cls(model, attn, kv, ops.ext)

    def plan(self, rows: int) -> tuple[list[torch.Tensor], list[int]] | None:
        """Every layer's tensors and linear kinds at `rows` rows (remembered per row count); None: the
        loop."""
        if rows in self._plans:
            return self._plans[rows]
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        plan: tuple[list[torch.Tensor], list[int]] | None = (weights, kinds)
        kv = self.kv
        for i, layer in enumerate(self.model.layers):
            found = [linear_kind(getattr(layer, name), rows) for name in LAYER_LINEARS]
            if any(f is None for f in found):
                plan = None
                break
            weights += [layer.input_norm.weight, layer.post_attn_norm.weight]
            for kind, tensors in found:
                kinds.append(kind)
                weights += tensors
            weights += [kv.k[i], kv.v[i]] + ([kv.k_scale[i], kv.v_scale[i]] if kv.quantized else [])
        self._plans[rows] = plan
        return plan

    def covers(self, meta: object, rows: int) -> bool:
        """This step is decode-only with the C++ attention's tables, and every linear has its kernel at
        `rows`."""
        return (isinstance(meta, TorchMeta) and meta.num_decode == rows and meta.decode_tables is not None
                and self.plan(rows) is not None)

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: TorchMeta) -> torch.Tensor:
        """x [rows, hidden] (the embeddings) through every decoder layer, in place."""
        weights, kinds = self.plan(x.shape[0])
        model, attn = self.model, self.attn
        if model._rope_cos is None:
            model.build_rope()
        return self.ext.decode_stack(x, weights, kinds, positions, model._rope_cos, model._rope_sin,
                                     meta.slot_mapping, meta.decode_tables, meta.decode_lens, attn.nh,
                                     attn.kvh, self.kv.block_size, attn.scale, self.eps, self.kv.quantized,
                                     quant.GROW)
