"""W8A16 (`worker.quant.a16`: csrc/w8a8_avx2.cpp `w8a16_avx2_linear` on AVX2, csrc/w8a8_small.cpp
`w8a16_small_linear` on AVX-512 VNNI): int16 activation rows times int8 weights, exact integer sums, the same
bits from both kernels; chosen by measurement for int8 weight-only linears such as the LM head."""

from __future__ import annotations

import pytest
import torch

from worker.kernels.cpu import extension
from worker.quant import a16
from worker.quant import calibrate as cal
from worker.quant import w8a8 as smooth
from worker.quant.weights import QuantLinear

pytestmark = pytest.mark.skipif(not smooth.avx2_available(), reason="the W8A16 kernel needs AVX2")
# each kernel built here (VNNI only on AVX-512 VNNI CPUs)
KINDS = [pytest.param("avx2"), pytest.param("vnni", marks=pytest.mark.skipif(
    not smooth.small_available(), reason="the VNNI W8A16 kernel needs AVX-512 VNNI"))]


def _reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: per-row int16 codes, int64 sums, then sum * row scale * column
    scale."""
    bound = extension().w8a16_avx2_bound(x.shape[1])
    xf = x.float()
    row_scale = xf.abs().amax(1).clamp(min=1e-30) / bound
    codes = torch.round(xf * (1 / row_scale)[:, None])
    assert codes.abs().max() <= bound
    sums = codes.long() @ qweight.long().t()
    return (sums.float() * row_scale[:, None] * scales.float()[None, :]).to(x.dtype)


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return q, torch.rand(n, generator=g) * 0.01 + 1e-3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 14, 65, 130])
@pytest.mark.parametrize("k,n", [(576, 208), (64, 16), (1536, 64), (576, 48)])
def test_kernel_is_bit_identical_to_its_integer_arithmetic(kind, dtype, rows, k, n):
    """Every row remainder (4-row passes, 1-3 rows left) and, on VNNI, a lone block after the block pairs
    (208, 48)."""
    q, scales = _weight(n, k)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    x[0, 5] = 57.0  # an outlier channel, as at the default model's head input
    x[-1, 6] = -57.0  # and a negative one: high bytes below zero
    lin = a16.A16Weight.build(q, scales, kind)
    assert lin.kind == kind
    got = lin(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert torch.equal(got, _reference(x, q, scales))


def test_close_to_the_fp32_product_with_outliers():
    q, scales = _weight(512, 576, seed=1)
    x = torch.randn(16, 576) * 3.8
    x[:, 7] = 57.0
    exact = x.double() @ (q.double() * scales.double()[:, None]).t()
    got = a16.A16Weight.build(q, scales)(x).double()
    bf16 = (x.bfloat16().double() @ (q.double() * scales.double()[:, None]).t())  # what bf16 activations give
    err, err_bf16 = (got - exact).norm() / exact.norm(), (bf16 - exact).norm() / exact.norm()
    assert err < 5e-4 and err < err_bf16 / 4, (err, err_bf16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [576, 4128])
def test_the_largest_sums_stay_exact(kind, k):
    """Every weight at +-127 and every activation at the row maximum: the int32 sums reach their bound."""
    bound = extension().w8a16_avx2_bound(k)
    assert bound * 127 * k < 2**31 and (bound == 16383 or (bound + 1) * 127 * k >= 2**31)
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[8:] = -127
    x = torch.full((2, k), 2.0)
    x[1] = -2.0  # codes of -bound: the most negative high bytes
    out = a16.A16Weight.build(q, torch.ones(16), kind)(x)
    expect = torch.tensor([127.0 * bound * k] * 8 + [-127.0 * bound * k] * 8) * (2.0 / bound)
    assert torch.allclose(out, torch.stack([expect, -expect]), rtol=1e-6)


def test_shapes_the_kernel_cannot_take_are_left_to_torch():
    assert a16.A16Weight.build(*_weight(12, 576)) is None  # out not a multiple of 8
    assert a16.A16Weight.build(*_weight(16, 570)) is None  # in not a multiple of 4
    # codes would fall below 12 bits
    assert a16.A16Weight.build(*_weight(16, a16.MAX_IN_FEATURES + 4)) is None
    assert a16.A16Weight.build(*_weight(24, 576), "vnni") is None  # VNNI blocks are 16 channels
    assert a16.A16Weight.build(*_weight(24, 576)).kind == "avx2"  # so such a weight takes the AVX2 kernel


@pytest.mark.skipif(not smooth.small_available(), reason="the VNNI W8A16 kernel needs AVX-512 VNNI")
def test_vnni_and_avx2_kernels_give_the_same_bits():
    q, scales = _weight(4096, 576, seed=4)
    x = torch.randn(16, 576, dtype=torch.bfloat16) * 4
    x[:, 3] = 57.0
    ours, theirs = (a16.A16Weight.build(q, scales, k) for k in ("vnni", "avx2"))
    for rows in (1, 4, 7, 16):
        assert torch.equal(ours(x[:rows]), theirs(x[:rows])), rows


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path))
    monkeypatch.setattr(cal, "_CALIBRATED", {})
    monkeypatch.setattr(cal, "_measured", False)


@pytest.mark.parametrize("a16_faster", [True, False])
def test_calibration_takes_int16_rows_only_where_faster(fresh, monkeypatch, a16_faster):
    lin = QuantLinear(torch.randn(64, 96) * 0.05, "int8")
    times = [1.0, 0.5] if a16_faster else [1.0, 1.5]  # torch's kernel, then ours
    monkeypatch.setattr(cal, "_interleaved_best", lambda fns, runs=5: list(times))
    cal.calibrate_a16(lin)
    assert (lin.a16 is not None) == a16_faster
    x = torch.randn(3, 96)
    expect = lin.a16(x) if a16_faster else torch._weight_int8pack_mm(x.to(lin.kernel_dtype), lin.qweight,
                                                                      lin.kernel_scales).float()
    assert torch.equal(lin(x), expect)
    cal.save_choices()
    monkeypatch.setattr(cal, "_CALIBRATED", {})  # a restart: the stored choice, nothing timed
    cal.restore_choices()
    monkeypatch.setattr(cal, "_interleaved_best", lambda fns, runs=5: pytest.fail("timed after a restart"))
    again = QuantLinear(torch.randn(64, 96) * 0.05, "int8")
    cal.calibrate_a16(again)
    assert (again.a16 is not None) == a16_faster


def _rounding_bound(x: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """How far each logit of the int16-row product may be from the exact x @ w.T (x [n, in], w [out, in] in
    fp64, w the exact q * scale): each activation moves by at most half a row step (`row_scale`), the sums are
    exact, and the scaling is in fp32."""
    mass = x.abs() @ w.abs().t()  # sum |x_k| |w_k|: bounds every partial sum
    return 0.51 * row_scale[:, None] * w.abs().sum(1)[None, :] + 2.0 ** -21 * mass


@pytest.mark.heavy  # a quality gate on the default model (36 s of make test on AMD Zen 3): `make test-heavy`
def test_default_model_head_on_int16_rows_keeps_its_perplexity(monkeypatch):
    """The default model's int8 LM head on int16 rows (`A16Weight` on fp32 rows: fp32 logits), on head inputs
    captured from the model, against the exact product of the same int8 weight (fp64): the same perplexity
    within 0.01%, and a different next token only where the exact logits are within the kernel's rounding
    bound. The dequantized model-dtype product (`forward_dense`) is the yardstick it must match or beat: with
    bf16 logits its top-1 disagrees with the exact one wherever rounding makes a tie (2.9% of positions on AMD
    Zen 4; more with Intel AMX's tiles), which made a check against it depend on the CPU. Nothing upstream
    depends on what was timed before: every other linear runs its dequantized product
    (`SWITCHYARD_QUANT_MAX_ROWS=0`)."""
    from bench.quant_decode import eval_ids, quantized, score
    from worker.model.loader import load_model

    monkeypatch.setenv(cal.MAX_ROWS_ENV, "0")
    lm = quantized(load_model("default", device="cpu", quantization="none"), "int8")
    head = lm.model.lm_head
    ids = eval_ids(lm)[:768]
    inputs: list[torch.Tensor] = []
    logits = head.logits  # what the model calls for its logits: capture its input

    def capture(x2: torch.Tensor) -> torch.Tensor:
        inputs.append(x2.detach().clone())
        return logits(x2)

    head.logits = capture
    score(lm, ids, 64)
    del head.logits
    x = torch.cat(inputs)[:-1]  # the rows that predict ids[1:]
    target = torch.tensor(ids[1:])
    w = head.qweight.double() * head.scales.double()[:, None]
    exact = x.double() @ w.t()
    ours = a16.A16Weight.build(head.qweight, head.scales)(x.float())  # fp32 rows: the model-dtype rows' codes
    dense = head.forward_dense(x).float()
    assert ours.dtype == torch.float32

    def perplexity(logits: torch.Tensor) -> float:
        return torch.nn.functional.cross_entropy(logits.double(), target).exp().item()

    ratio = perplexity(ours) / perplexity(exact)
    assert abs(ratio - 1) < 1e-4, ratio
    picks, best = ours.argmax(1), exact.argmax(1)
    agree = (picks == best).float().mean()
    assert agree >= (dense.argmax(1) == best).float().mean()
    differ = (picks != best).nonzero()[:, 0]
    rows = torch.arange(len(differ))
    xd = x[differ].double()
    bound = _rounding_bound(xd, w, xd.abs().amax(1) / extension().w8a16_avx2_bound(x.shape[1]))
    gap = exact[differ, best[differ]] - exact[differ, picks[differ]]
    assert (gap <= bound[rows, best[differ]] + bound[rows, picks[differ]]).all(), gap
