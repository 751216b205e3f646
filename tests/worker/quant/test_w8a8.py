"""W8A8 (`worker.quant.w8a8`): the C++ activation quantizer against its torch definition, the smoothed int8
product against the float one, and the mode end to end from the GGUF (its perplexity gate is in
test_quantization.py)."""

from __future__ import annotations

import pytest
import torch

from worker.kernels.cpu import extension
from worker.model.loader import load_model
from worker.quant import calibrate as cal
from worker.quant import w8a8 as smooth
from worker.quant import weights as quant


def _reference_quantize(x: torch.Tensor, inv_smooth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = x.float() * inv_smooth
    scale = v.abs().amax(-1).clamp(min=1e-6) / 127
    return torch.round(v * (1.0 / scale)[:, None]).to(torch.int8), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_its_definition(dtype):
    """Per-row scale from the smoothed maximum, codes rounded half to even; 40 columns: vector body and
    tail."""
    ext = extension()
    assert ext is not None and smooth.available()
    torch.manual_seed(0)
    x = (torch.randn(37, 40) * torch.logspace(-2, 2, 40)).to(dtype)
    x[5] = 0  # an all-zero row: finite scale, zero codes
    inv = torch.rand(40) + 0.25
    q, rs = ext.w8a8_quantize(x.contiguous(), inv, 0)
    want_q, want_rs = _reference_quantize(x, inv)
    assert torch.equal(rs, want_rs)
    assert (q.int() - want_q.int()).abs().max().item() <= 1  # the same fp32 products; a tie may round apart
    assert (q != want_q).float().mean().item() < 1e-3
    assert q.abs().max().item() == 127 and torch.equal(q[5], torch.zeros(40, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_smoothed_product_is_close_and_beats_unsmoothed_on_outlier_channels(dtype):
    torch.manual_seed(1)
    w = torch.randn(96, 128) * 0.05
    x = torch.randn(64, 128)
    x[:, [3, 70]] *= 40  # activation outlier channels, as after RMSNorm in real models
    exact = x @ w.t()
    act_max = x.abs().amax(0)
    errs = {}
    for name, am in (("smoothed", act_max), ("plain", None)):
        lin = smooth.W8A8Weight.build(w.to(dtype), am)
        got = lin(x.to(dtype).contiguous())
        assert got.dtype == dtype and got.shape == (64, 96)
        errs[name] = ((got.float() - exact).norm() / exact.norm()).item()
    assert errs["smoothed"] < 0.02
    assert errs["smoothed"] < errs["plain"]


@pytest.mark.skipif(not smooth.small_available(), reason="the few-row kernel needs AVX-512 VNNI")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(48, 40), (80, 576), (960, 576)])
def test_few_row_kernel_is_bit_identical_to_int_mm(dtype, n, k):
    """Same int32 sums and the same fp32 dequantization as the _int_mm path at every row count (8-row passes
    over block pairs, then 4-row tiles and their remainders, and a lone block's tiles); the packed layout is
    what vpdpbusd reads."""
    torch.manual_seed(2)
    w = torch.randn(n, k) * 0.05
    lin = smooth.W8A8Weight.build(w.to(dtype), torch.rand(k) + 0.5)
    assert lin.small is not None
    packed, colsum = lin.small
    assert packed.shape == (n // 16, k // 4, 64) and torch.equal(colsum, lin.wt.int().sum(0).int())
    assert torch.equal(packed[1, 2].view(16, 4), lin.wt[8:12, 16:32].t())  # block 1, group 2: lanes x 4 bytes
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 27):
        x = (torch.randn(rows, k) * torch.logspace(-1, 1, k)).to(dtype)
        assert torch.equal(lin.forward_small(x), lin.forward_int_mm(x)), rows


@pytest.mark.skipif(not smooth.avx2_available(), reason="the AVX2 W8A8 kernel needs AVX2")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(24, 40), (80, 576), (576, 1536)])
def test_avx2_kernel_is_bit_identical_to_int_mm(dtype, n, k):
    """The AVX2 kernels (`vpmaddubsw`: the activation's sign moved onto the weight, |x| x w pairs below 2^15;
    and the int16 products over sign-extended codes) give the _int_mm path's outputs bit for bit at every row
    count (4-row tiles and their remainders, 2-block channel tiles and a lone block, more rows than one 64-row
    pass), the extremes too (codes of +-127 in every term)."""
    torch.manual_seed(3)
    w = torch.randn(n, k) * 0.05
    w[:, 0] = 1.0  # a column of full-scale weights: +-127 codes against the activations' +-127
    lin = smooth.W8A8Weight.build(w.to(dtype), torch.rand(k) + 0.5, kernel="avx2")
    assert lin.small_kind == "avx2" and lin.small_rows == smooth.AVX2_ROWS
    packed, colsum = lin.small
    assert colsum is None and packed.shape == (n // 8, k // 4, 32)
    assert torch.equal(packed[1, 2].view(8, 4), lin.wt[8:12, 8:16].t())  # block 1, group 2: lanes x 4 bytes
    ext = extension()
    default = ext.w8a8_avx2_wide_rows(0)
    try:
        for wide_from in (1, 1 << 30):  # the int16-product kernel at every row count, then `vpmaddubsw`'s
            ext.w8a8_avx2_wide_rows(wide_from)
            for rows in (1, 2, 3, 4, 5, 7, 64, 67, 130):
                x = (torch.randn(rows, k) * torch.logspace(-1, 1, k)).to(dtype)
                x[0] = -x[0].abs()  # a row of negative activations: every sign moves onto the weights
                assert torch.equal(lin.forward_small(x), lin.forward_int_mm(x)), (wide_from, rows)
                # __call__ takes the kernel at every rows
                assert torch.equal(lin(x), lin.forward_int_mm(x)), rows
    finally:
        ext.w8a8_avx2_wide_rows(default)


def test_w8a8_on_avx2_without_int8_dot_builds_with_the_avx2_kernel(monkeypatch):
    """AVX2-only CPUs (Zen 3): an asked w8a8 stays w8a8 (`auto` is none: bench/greedy_agreement.py), and its
    weights build with the AVX2 kernel."""
    monkeypatch.setattr(smooth, "has_int8_dot", lambda: False)
    monkeypatch.setattr(smooth, "small_available", lambda: False)
    assert quant.resolve_mode("auto", torch.device("cpu")) == "none"
    assert quant.resolve_mode("w8a8", torch.device("cpu")) == "w8a8"
    lin = quant.QuantLinear(torch.randn(96, 64) * 0.05, "w8a8", act_max=torch.rand(64) + 0.5)
    cal.calibrate(lin)
    assert lin.w8a8.small_kind == ("avx2" if smooth.avx2_available() else "")
    # W8A8 throughout: no weight-only copy (which rows take the kernel is measured)
    if smooth.avx2_available():
        assert lin.max_rows == 0 and lin.qweight is None
        x = torch.randn(5, 64)
        assert torch.equal(lin(x), lin.w8a8.forward_int_mm(x))


@pytest.mark.parametrize("k", [40, 576, 1032, 1536, 2100])
def test_fp32_int8_product_is_bit_identical_to_int_mm(k):
    """The product AVX2-only CPUs use (fp32 GEMMs over K slices of at most 1,032) equals torch._int_mm
    exactly, at the extremes too (-128 activations x -127 weights in every term), on every CPU."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randint(-128, 128, (19, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (k, 24), dtype=torch.int8, generator=gen)
    x[0], w[:, 0] = -128, -127
    got = smooth.int8_matmul_fp32(x, w)
    assert got.dtype == torch.int32 and torch.equal(got, torch._int_mm(x, w))
    assert got[0, 0].item() == 128 * 127 * k


@pytest.mark.heavy  # quality gate / default-model end to end: `make test-heavy`, its own CI step
def test_w8a8_mode_from_the_gguf():
    """Decode-sized inputs take the few-row W8A8 kernel on VNNI (prefill-sized ones `_int_mm`), every size the
    AVX2 kernel on AVX2-only CPUs, else the weight-only int8 kernel; no dense copy."""
    loaded = load_model("default", device="cpu", quantization="w8a8")
    assert loaded.quantization == "w8a8"
    lin = loaded.model.layers[2].gate_up
    assert isinstance(lin, quant.QuantLinear) and lin.w8a8 is not None and lin.dense is None
    assert not torch.equal(lin.w8a8.inv_smooth, torch.ones_like(lin.w8a8.inv_smooth))  # calibrated
    x = torch.randn(64, lin.in_features, dtype=loaded.dtype)
    small = torch.cat([lin(x[i:i + 1]) for i in range(64)]).float()  # weight-only kernel, row by row
    big = lin(x).float()
    assert lin.max_rows < 64
    assert ((big - small).norm() / small.norm()).item() < 0.05
    if lin.w8a8.small is not None:  # W8A8 throughout: the product of a row does not depend on its batch
        assert lin.max_rows == 0 and lin.w8a8.small_rows >= 1
        assert torch.equal(big, small)
        assert lin.qweight is None  # the weight-only copy is dropped; the floor counts the packed one
        int8 = load_model("default", quantization="int8")
        assert quant.weight_bytes(loaded.model) > 0.9 * quant.weight_bytes(int8.model)


@pytest.mark.parametrize("int_mm_share,expect_all", [(0.97, True), (0.5, False)])
def test_small_rows_calibration_keeps_the_kernel_unless_int_mm_is_clearly_faster(int_mm_share, expect_all):
    """`_int_mm` 3% faster (within host noise) leaves the AVX2 kernel every row count; twice as fast takes
    over."""
    import time
    from types import SimpleNamespace

    kernel_s = 0.004
    w = SimpleNamespace(small=object(), small_kind="avx2", wt=torch.zeros(4, 12 if expect_all else 20),
                        forward_small=lambda x: time.sleep(kernel_s),
                        forward_int_mm=lambda x: time.sleep(kernel_s * int_mm_share))
    rows = cal.calibrate_small_rows(w, torch.float32)
    assert rows == (smooth.AVX2_ROWS if expect_all else 0)
