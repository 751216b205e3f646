"""The fused W8A8 MLP middle (`FusedOps.mlp`, `w8a8_silu_mul_quantize`): gate_up's sums to down's codes in one
pass, bit-identical to dequantize + SiLU·mul + quantize, and taken only where both linears run the large-row
path."""

from __future__ import annotations

import pytest
import torch

from worker.kernels.cpu import extension
from worker.kernels.cpu_features import has_int8_dot
from worker.kernels.layer_ops import FusedOps
from worker.quant import onednn_int8
from worker.quant import w8a8 as smooth
from worker.quant import weights as quant

pytestmark = pytest.mark.skipif(not smooth.available(), reason="needs the C++ W8A8 passes")


class _Recorder:
    """The extension, counting calls of the fused kernel."""

    def __init__(self, ext) -> None:
        self.ext, self.fused = ext, 0

    def __getattr__(self, name):
        if name == "w8a8_silu_mul_quantize":
            self.fused += 1
        return getattr(self.ext, name)


def _mlp(dtype: torch.dtype, hidden: int = 64, inter: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = quant.QuantLinear((torch.randn(2 * inter, hidden, generator=g) * 0.05).to(dtype), "w8a8",
                                act_max=torch.rand(hidden, generator=g) * 3 + 0.5)
    down = quant.QuantLinear((torch.randn(hidden, inter, generator=g) * 0.05).to(dtype), "w8a8",
                             act_max=torch.rand(inter, generator=g) * 3 + 0.5)
    for lin in (gate_up, down):
        lin.max_rows, lin.w8a8.small_rows = 0, 8
    return gate_up, down


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("onednn", [False, True])
def test_fused_middle_is_bit_identical_to_the_three_passes(dtype, onednn):
    if onednn and not (onednn_int8.available() and has_int8_dot()):
        pytest.skip("oneDNN's product is chosen only with int8 dot products")
    ext = extension()
    gate_up, down = _mlp(dtype)
    if onednn:
        for lin in (gate_up, down):
            lin.w8a8.onednn = onednn_int8.OnednnInt8Weight.pack(lin.w8a8.wt)
    ops = FusedOps(_Recorder(ext))
    torch.manual_seed(1)
    for rows in (9, 16, 17, 100):
        h = (torch.randn(rows, 64) * 2).to(dtype)
        want = down(ext.silu_mul(gate_up(h)))
        got = ops.mlp(h, gate_up, down)
        assert got.dtype == dtype and got.shape == (rows, 64)
        assert torch.equal(got, want), (rows, (got.float() - want.float()).abs().max().item())
    assert ops.ext.fused == 4


def test_few_rows_take_the_unfused_path():
    gate_up, down = _mlp(torch.bfloat16)
    ops = FusedOps(_Recorder(extension()))
    h = torch.randn(8, 64, dtype=torch.bfloat16)  # at the few-row cutoff
    assert torch.equal(ops.mlp(h, gate_up, down), down(extension().silu_mul(gate_up(h))))
    down.w8a8.small_rows = 64  # gate_up large, down not: unfused too
    ops.mlp(torch.randn(20, 64, dtype=torch.bfloat16), gate_up, down)
    assert ops.ext.fused == 0


def test_bad_shapes_raise():
    ext = extension()
    with pytest.raises(RuntimeError, match="sums"):
        ext.w8a8_silu_mul_quantize(torch.zeros(4, 10, dtype=torch.int32), torch.ones(4), torch.ones(10),
                                   torch.ones(4), torch.empty(0, dtype=torch.bfloat16), 0)
    with pytest.raises(RuntimeError, match="fp32 scales"):
        ext.w8a8_silu_mul_quantize(torch.zeros(4, 8, dtype=torch.int32), torch.ones(4), torch.ones(3),
                                   torch.ones(4), torch.empty(0, dtype=torch.bfloat16), 0)
