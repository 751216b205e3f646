"""oneDNN's int8 product for W8A8 (`worker.quant.onednn_int8`): the same bits as the `_int_mm` path at any row
count, padded quantization, the measured choice and its override, and the decode stack leaving such linears to
Python."""

from __future__ import annotations

import pytest
import torch

from worker.kernels.cpu import extension
from worker.kernels.cpu_features import has_amx_int8, has_int8_dot
from worker.model.decode_stack import linear_kind
from worker.quant import calibrate as cal
from worker.quant import onednn_int8
from worker.quant import w8a8 as smooth
from worker.quant import weights as quant

pytestmark = pytest.mark.skipif(not (smooth.available() and onednn_int8.available()),
                                reason="needs the C++ W8A8 passes and torch's oneDNN quantized linear")


def _weight(n: int, k: int, seed: int = 0) -> smooth.W8A8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    act_max = torch.rand(k, generator=g) * 4 + 0.5
    return smooth.W8A8Weight.build(w, act_max, kernel="none")


@pytest.mark.skipif(not has_int8_dot(),
                    reason="chosen only with int8 dot products (oneDNN's AVX2 path saturates)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 40)])
def test_onednn_product_is_bit_identical_to_int_mm(dtype, n, k):
    """Unit scales return the int32 sums as fp32 integers, so the dequantized output has the same bits; row
    counts off the padding bucket and on it, one row and many. K = 1,536 sums pass 2^24 in fp32 only for
    extreme codes."""
    w = _weight(n, k)
    packed = onednn_int8.OnednnInt8Weight.pack(w.wt)
    torch.manual_seed(1)
    # without AMX oneDNN runs its reference loops here (seconds a call at 300 rows): a shorter list off AMX
    for rows in (1, 15, 16, 17, 100, 300) if has_amx_int8() else (1, 16, 17, 100):
        x = (torch.randn(rows, k) * 3).to(dtype)
        w.onednn = None
        want = w.forward_int_mm(x)
        w.onednn = packed
        got = w.forward_int_mm(x)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert torch.equal(got, want), (rows, (got.float() - want.float()).abs().max().item())


def test_quantize_pads_rows_with_zero_codes():
    ext = extension()
    torch.manual_seed(2)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    inv = torch.rand(64) + 0.5
    q0, rs0 = ext.w8a8_quantize(x, inv, 0)
    q, rs = ext.w8a8_quantize(x, inv, 16)
    assert q.shape == (16, 64) and rs.shape == (5,)
    assert torch.equal(q[:5], q0) and torch.equal(rs, rs0)
    assert not q[5:].any()
    pads = {n: onednn_int8.padded_rows(n) for n in (1, 16, 17, 128, 129, 512, 513, 1000)}
    assert pads == {1: 16, 16: 16, 17: 32, 128: 128, 129: 160, 512: 512, 513: 576, 1000: 1024}
    assert len({onednn_int8.padded_rows(n) for n in range(1, 1025)}) == 28  # kernels per linear shape


def test_dequantize_takes_int32_or_fp32_sums_alike():
    ext = extension()
    acc = torch.randint(-(1 << 20), 1 << 20, (7, 48), dtype=torch.int32)
    rs, cs = torch.rand(7), torch.rand(48)
    like = torch.empty(7, 48, dtype=torch.bfloat16)
    assert torch.equal(ext.w8a8_dequantize(acc, rs, cs, like), ext.w8a8_dequantize(acc.float(), rs, cs, like))
    with pytest.raises(RuntimeError, match="int32 or fp32"):
        ext.w8a8_dequantize(acc.double(), rs, cs, like)


@pytest.mark.parametrize("onednn_faster", [True, False])
def test_the_choice_follows_the_measurement(monkeypatch, onednn_faster):
    """Timed with a stand-in clock that makes one path faster: the weight is prepacked only where oneDNN
    won."""
    monkeypatch.delenv(cal.INT8_GEMM_ENV, raising=False)
    monkeypatch.setattr(cal, "has_int8_dot", lambda: True)
    monkeypatch.setattr(cal, "has_amx_int8", lambda: True)
    monkeypatch.setattr(cal, "_CALIBRATED", {})
    w = _weight(64, 32)

    def fake_time(fn, runs=5):
        fn()
        return 1.0 if (w.onednn is not None) == onednn_faster else 2.0

    monkeypatch.setattr(cal, "_best_time", fake_time)
    cal.calibrate_int8_gemm(w, torch.bfloat16)
    assert (w.onednn is not None) == onednn_faster
    other = _weight(64, 32, seed=3)  # the same shape again: the remembered choice, no new timing
    monkeypatch.setattr(cal, "_best_time", lambda fn, runs=5: pytest.fail("measured twice"))
    cal.calibrate_int8_gemm(other, torch.bfloat16)
    assert (other.onednn is not None) == onednn_faster


def test_a_far_slower_first_size_ends_the_measurement(monkeypatch):
    """oneDNN 10x slower at 64 rows (its reference loops): the 512-row calls are never timed, nothing is
    packed."""
    monkeypatch.delenv(cal.INT8_GEMM_ENV, raising=False)
    monkeypatch.setattr(cal, "has_int8_dot", lambda: True)
    monkeypatch.setattr(cal, "has_amx_int8", lambda: True)
    monkeypatch.setattr(cal, "_CALIBRATED", {})
    w = _weight(64, 32)
    timed: list[tuple[int, bool]] = []

    def fake_time(fn, runs=5):
        timed.append((w.onednn is not None, len(timed)))
        return 10.0 if w.onednn is not None else 1.0

    monkeypatch.setattr(cal, "_best_time", fake_time)
    cal.calibrate_int8_gemm(w, torch.bfloat16, rows=(64, 512))
    assert w.onednn is None and len(timed) == 2  # one size, both candidates


def test_without_amx_onednn_is_not_measured(monkeypatch):
    """On VNNI CPUs without AMX (AMD Zen 4: oneDNN's reference loops) the weight keeps `_int_mm`, untimed."""
    monkeypatch.delenv(cal.INT8_GEMM_ENV, raising=False)
    monkeypatch.setattr(cal, "has_int8_dot", lambda: True)
    monkeypatch.setattr(cal, "has_amx_int8", lambda: False)
    monkeypatch.setattr(cal, "_CALIBRATED", {})
    monkeypatch.setattr(cal, "_best_time", lambda fn, runs=5: pytest.fail("measured without AMX"))
    w = _weight(64, 32)
    cal.calibrate_int8_gemm(w, torch.bfloat16)
    assert w.onednn is None


@pytest.mark.parametrize("env,want", [("onednn", True), ("int_mm", False)])
def test_the_environment_fixes_the_choice(monkeypatch, env, want):
    monkeypatch.setenv(cal.INT8_GEMM_ENV, env)
    monkeypatch.setattr(cal, "has_int8_dot", lambda: True)
    monkeypatch.setattr(cal, "_best_time", lambda fn, runs=5: pytest.fail("measured despite the override"))
    w = _weight(64, 32)
    cal.calibrate_int8_gemm(w, torch.float32)
    assert (w.onednn is not None) == want


def test_an_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv(cal.INT8_GEMM_ENV, "amx")
    with pytest.raises(ValueError, match="SWITCHYARD_INT8_GEMM='amx'"):
        cal.calibrate_int8_gemm(_weight(64, 32), torch.float32)


def test_decode_stack_leaves_onednn_linears_to_python():
    """Above the few-row cutoff a oneDNN-packed linear is not one of the C++ stack's kernels."""
    lin = quant.QuantLinear(torch.randn(64, 32) * 0.05, "w8a8", quant.INT4_GROUP, torch.rand(32) + 0.5)
    lin.max_rows = 0
    w = lin.w8a8
    w.onednn = onednn_int8.OnednnInt8Weight.pack(w.wt)
    assert linear_kind(lin, w.small_rows + 1) is None
    w.onednn = None
    if cal.has_int8_dot():
        assert linear_kind(lin, w.small_rows + 1)[0] == 3  # INT_MM
