"""Our torch dequantization of GGUF blocks gives gguf-py's bits (Q4_1, Q8_0 and a type it passes through), on
blocks quantized here and on the shipped model's tensors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from worker.model.gguf_dequant import dequantize
from worker.text.gguf_index import read_index
from worker.text.model_source import default_model_path


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.F16])
def test_bits_equal_gguf_py(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 4.0, (6, 1))).astype(np.float32)
    x[2, :32] = 0.0  # a block of zeros: d = 0
    raw = gguf.quants.quantize(x, qtype)
    ours = dequantize(raw, int(qtype))
    ref = gguf.quants.dequantize(raw, qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape == (6, 128)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
    # and it is the data, not just the same mistake
    err = (ours - torch.from_numpy(x)).abs().max(dim=1).values
    assert (err <= 0.1 * torch.from_numpy(np.abs(x)).max(dim=1).values).all(), err


def test_the_shipped_models_tensors_dequantize_to_gguf_pys_bits() -> None:
    path = default_model_path()
    seen = set()
    for t, data in read_index(path).arrays(path):
        if t.qtype in seen:  # one tensor of each type the file has
            continue
        seen.add(t.qtype)
        ref = np.array(gguf.quants.dequantize(data, Q(t.qtype)), dtype=np.float32)  # a writable copy
        assert torch.equal(dequantize(data, t.qtype), torch.from_numpy(ref)), t.name
    assert {int(Q.Q4_1), int(Q.Q8_0)} <= seen
