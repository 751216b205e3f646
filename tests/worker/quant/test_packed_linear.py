"""Prepacked oneDNN bf16 linear layers: bit-identical to `F.linear` over the same (padded) rows, padded to a
bounded set of row counts, and the int8 row cutoff is honoured."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from worker.config import EngineConfig
from worker.engine.debug import DebugEngine
from worker.model.loader import load_any
from worker.protocol import SamplingParams
from worker.quant import calibrate as cal
from worker.quant import weights as quant
from worker.quant.onednn_int8 import padded_rows
from worker.quant.packed import EXACT_ROWS, PackedLinear, can_pack, pack_model

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU build has no oneDNN bf16 path")


def padded_f_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear` over the rows PackedLinear runs: above EXACT_ROWS, zero rows up to `padded_rows`."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if rows > EXACT_ROWS:
        x2 = torch.cat([x2, x2.new_zeros(padded_rows(rows) - rows, x2.shape[1])])
    return F.linear(x2, w)[:rows].reshape(*x.shape[:-1], w.shape[0])


class PaddedPlainLinear(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return padded_f_linear(x, self.w)


def test_packed_linear_is_bit_identical_to_f_linear_over_the_same_rows():
    torch.manual_seed(0)
    for out_f, in_f in ((96, 64), (576, 1536)):
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
        lin = PackedLinear(w)
        assert torch.equal(lin.weight, w)
        for rows in (1, 3, 16, 17, 33, 130, 515):
            x = torch.randn(rows, in_f, dtype=torch.bfloat16)
            assert torch.equal(lin(x), padded_f_linear(x, w))
            if rows <= EXACT_ROWS:
                assert torch.equal(lin(x), F.linear(x, w))
        x3 = torch.randn(2, 5, in_f, dtype=torch.bfloat16)
        assert torch.equal(lin(x3), F.linear(x3, w))
        assert torch.equal(copy.deepcopy(lin)(x3), F.linear(x3, w))


def test_row_counts_above_the_exact_ones_fall_in_few_buckets():
    assert padded_rows(17) == 32 and padded_rows(129) == 160 and padded_rows(513) == 576
    assert len({padded_rows(r) for r in range(EXACT_ROWS + 1, 1025)}) <= 28


def test_packed_tiny_model_generates_the_same_greedy_tokens():
    prompts = [[5, 9, 11, 3, 7, 2, 8] * 3, [4, 4, 6, 1]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for packed in (False, True):
        loaded = load_any("tiny-random", dtype="bfloat16")
        if not packed:  # load_any packed it: rebuild the plain layers from the dense weights
            for layer in loaded.model.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    lin = getattr(layer, name)
                    setattr(layer, name, PaddedPlainLinear(lin.weight.clone()))
        else:
            assert isinstance(loaded.model.layers[0].qkv, PackedLinear)
            assert pack_model(loaded.model) == 0  # nothing left to pack
        engine = DebugEngine(loaded, EngineConfig(dtype="bfloat16", kv_cache_bytes=16 << 20))
        outs.append(engine.generate(prompts, params))
    assert outs[0] == outs[1]


def test_int8_cutoff_from_environment(monkeypatch):
    monkeypatch.setenv(cal.MAX_ROWS_ENV, "3")
    loaded = load_any("tiny-random", dtype="bfloat16", quantization="int8")
    lin = loaded.model.layers[0].gate_up
    assert isinstance(lin, quant.QuantLinear) and lin.max_rows == 3 and lin.dense is not None
    calls = []
    monkeypatch.setattr(lin, "forward_quantized", lambda x2: calls.append(x2.shape[0]) or
                        torch.zeros(x2.shape[0], lin.out_features, dtype=x2.dtype))
    lin(torch.randn(3, lin.in_features, dtype=torch.bfloat16))
    # packed bf16 copy of the dequantized weight
    big = lin(torch.randn(4, lin.in_features, dtype=torch.bfloat16))
    assert calls == [3]
    x = torch.randn(4, lin.in_features, dtype=torch.bfloat16)
    assert big.shape == (4, lin.out_features)
    assert torch.equal(lin(x), F.linear(x, lin.dequantize()))


def test_int8_cutoff_calibrates_without_environment(monkeypatch):
    monkeypatch.delenv(cal.MAX_ROWS_ENV, raising=False)
    lin = quant.QuantLinear(torch.randn(256, 128, dtype=torch.bfloat16) * 0.05, "int8")
    rows = cal.calibrate_max_rows(lin, candidates=(1, 2, 4))
    assert rows in (0, 1, 2, 4)


def test_head_logits_order_near_ties_as_the_unrounded_product():
    """Logits 25 and 25.03125 both round to 25 in bf16 (the tie went to the lower id); the head's `logits`
    re-scores the leaders in fp32 and picks the larger, and leaves every other logit as the bf16 product."""
    from worker.quant.packed import PackedLinear

    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    w[:, 0] = torch.linspace(-3, 3, 64).bfloat16()
    w[5, 0], w[9, 0], w[9, 1] = 25.0, 25.0, 0.03125
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[:, 0], x[:, 1] = 1.0, 1.0
    x[1, 1] = -1.0  # the second row: 5 leads
    head = PackedLinear(w, w)
    rounded = head(x).float()
    assert rounded[0, 5] == rounded[0, 9] == 25.0 and rounded[0].argmax() == 5  # the tie rounding made
    got = head.logits(x)
    assert got.dtype == torch.float32 and got.argmax(1).tolist() == [9, 5]
    assert got[0, 9] == 25.03125 and got[1, 9] == 24.96875
    others = torch.ones_like(got, dtype=torch.bool)
    others[:, [5, 9]] = False
    assert torch.equal(got[others], rounded[others])  # only the leaders were re-scored
    assert torch.equal(PackedLinear(w).logits(x), rounded)  # without the plain weight: the bf16 product
