"""The C++ decode stack (`worker.model.decode_stack`): a decode-only step through it gives the Python layer
loop's logits bit for bit, for every linear kind it runs and both KV page dtypes; steps it does not cover take
the loop."""

from __future__ import annotations

import pytest
import torch

from worker.config import ModelConfig
from worker.kernels.cpu import extension
from worker.kernels.cpu_features import has_int8_dot
from worker.kvcache.tensors import KVCache
from worker.model import decode_stack as ds
from worker.model.attention import BatchLayout
from worker.model.backends import make_backend, make_ops
from worker.model.llama import StepContext
from worker.model.tiny_model import random_model
from worker.quant import a16
from worker.quant import w8a8 as smooth
from worker.quant import weights as quant

pytestmark = pytest.mark.skipif(extension() is None, reason="needs the C++ CPU kernels")

BS, CONTEXT = 16, 70
# the default model's attention shape (3 query heads per KV head, 64 wide) on a small, fast model
CFG = ModelConfig(vocab_size=512, hidden_size=192, intermediate_size=384, num_layers=3, num_heads=6,
                  num_kv_heads=2, head_dim=64, max_position=1024, tie_word_embeddings=True)


def _model(mode: str, dtype: torch.dtype = torch.bfloat16):
    loaded = random_model(CFG, dtype=dtype, seed=7)
    quant.quantize_model(loaded.model, mode)
    return loaded.model


def _linears(model) -> list[quant.QuantLinear]:
    return [getattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]


def _kernel_model():
    """A w8a8 model whose few-row calls take this CPU's own kernel, whatever the calibration measured here (on
    an AMX host oneDNN's product or `_int_mm` can win it, and then no step would be the stack's)."""
    model = _model("w8a8")
    for m in _linears(model):
        if m.w8a8.small is None:
            pytest.skip("no few-row W8A8 kernel was built on this CPU")
        m.w8a8.small_rows = 64
    return model


def _setup(model, kv_dtype: str):
    dev, dtype = torch.device("cpu"), model.norm.weight.dtype
    attn = make_backend("torch", CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, BS, dev)
    pages = 160  # 17 sequences of up to 6 pages
    kv = KVCache(CFG, pages, BS, dtype, dev, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(3)
    for t in kv.k + kv.v:
        t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8) if kv.quantized
                else torch.randn(t.shape, generator=g))
    for s in kv.k_scale + kv.v_scale:
        s.fill_(0.02)
    ops = make_ops(True, dev, dtype)
    return attn, kv, ops, ds.DecodeStack.build(model, attn, kv, ops)


def _forward(model, attn, kv, ops, stack, rows: int, prefill: int = 0):
    """Logits of `rows` decoding sequences (distinct pages, contexts CONTEXT + i) and, with `prefill`, one
    prompt chunk of that many tokens after them."""
    per = -(-(CONTEXT + rows + 1) // BS)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
    lens = [CONTEXT + i for i in range(rows)]
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens, strict=True)]
    pos = [n - 1 for n in lens]
    pf_tables, pf_q, pf_ctx = [], [], []
    if prefill:
        table = list(range(rows * per, rows * per + -(-prefill // BS)))
        slots += [table[i // BS] * BS + i % BS for i in range(prefill)]
        pos += list(range(prefill))
        pf_tables, pf_q, pf_ctx = [table], [prefill], [prefill]
    lay = BatchLayout(BS, torch.tensor(slots), tables, lens, pf_tables, pf_q, pf_ctx)
    ids = torch.randint(0, CFG.vocab_size, (len(pos),), generator=torch.Generator().manual_seed(rows))
    out_rows = torch.arange(len(pos))
    with torch.inference_mode():
        ctx = StepContext(torch.tensor(pos), out_rows, attn, attn.prepare(lay, kv.k[0].device), kv, ops,
                          stack)
        return model(ids, ctx)


def _same_as_loop(model, kv_dtype: str, rows: int, want_kind: int) -> None:
    attn, kv, ops, stack = _setup(model, kv_dtype)
    assert stack is not None and stack.plan(rows) is not None
    assert set(stack.plan(rows)[1]) == {want_kind}
    snapshot = [t.clone() for t in kv.k + kv.v + kv.k_scale + kv.v_scale]
    loop = _forward(model, attn, kv, ops, None, rows)
    after_loop = [t.clone() for t in kv.k + kv.v + kv.k_scale + kv.v_scale]
    for t, s in zip(kv.k + kv.v + kv.k_scale + kv.v_scale, snapshot, strict=True):
        t.copy_(s)
    got = _forward(model, attn, kv, ops, stack, rows)
    assert torch.equal(got, loop)
    # the same K/V rows (and int8 page scales) written
    assert all(torch.equal(a, b) for a,
               b in zip(after_loop, kv.k + kv.v + kv.k_scale + kv.v_scale, strict=True))


@pytest.mark.parametrize("kv_dtype", ["int8", "model"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_w8a8_few_row_kernel(kv_dtype, rows):
    if not smooth.small_available():
        pytest.skip("the few-row VNNI kernel needs AVX-512 VNNI")
    model = _model("w8a8")
    for m in _linears(model):
        m.w8a8.small_rows = 64  # whatever the calibration measured here: the kernel for these rows
    _same_as_loop(model, kv_dtype, rows, ds.VNNI)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7])
def test_w8a8_avx2_kernel(monkeypatch, rows, dtype):
    """Every x86-64 CPU has AVX2: the kernel Zen 3 runs (in fp32 there) is checked on all of them."""
    monkeypatch.setattr(smooth, "small_available", lambda: False)
    monkeypatch.setattr(smooth, "has_int8_dot", lambda: False)
    if not smooth.avx2_available():
        pytest.skip("the AVX2 kernel was not built")
    model = _model("w8a8", dtype)
    for m in _linears(model):
        m.w8a8.small_rows = smooth.AVX2_ROWS  # whatever the calibration measured on this CPU
    _same_as_loop(model, "int8", rows, ds.AVX2)


def test_int_mm_above_the_few_row_cutoff():
    if not has_int8_dot():
        pytest.skip("torch._int_mm is the large-row path only with int8 dot products")
    model = _model("w8a8")
    for m in _linears(model):
        m.max_rows, m.w8a8.small_rows = 0, 0
        m.w8a8.onednn = None  # where oneDNN's product won at load, the stack leaves the linear to Python
    _same_as_loop(model, "int8", 6, ds.INT_MM)


def test_weight_only_int8():
    model = _model("int8")
    for m in _linears(model):
        m.max_rows, m.a16 = 64, None  # torch's kernel, whatever the calibration measured here
    _same_as_loop(model, "model", 4, ds.WEIGHT_ONLY)


@pytest.mark.parametrize("kind", ["avx2", "vnni"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_only_int8_on_int16_rows(dtype, kind):
    if not a16.A16Weight.fits(torch.zeros(64, 64, dtype=torch.int8), kind):
        pytest.skip(f"the {kind} W8A16 kernel is not built on this CPU")
    model = _model("int8", dtype)
    for m in _linears(model):
        m.max_rows, m.a16 = 64, a16.A16Weight.build(m.qweight, m.scales, kind)
    _same_as_loop(model, "model", 5, ds.A16 if kind == "avx2" else ds.A16_VNNI)


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_packed_bf16_linears(kv_dtype, rows):
    """An unquantized bf16 model's oneDNN-packed linears (`PackedLinear`) run in the stack up to their
    unpadded row count; above it (padded rows) the loop runs them."""
    from worker.quant.packed import EXACT_ROWS, can_pack, pack_model

    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN bf16 packing is not available on this CPU")
    model = _model("none")
    assert pack_model(model) > 0
    _same_as_loop(model, kv_dtype, rows, ds.PACKED)
    assert ds.DecodeStack.build(model, *_setup(model, kv_dtype)[:3]).plan(EXACT_ROWS + 1) is None


def test_steps_it_does_not_cover_take_the_loop():
    model = _kernel_model()
    attn, kv, ops, stack = _setup(model, "int8")
    # a step with a prompt chunk: not decode-only
    calls = []
    real = stack.run
    stack.run = lambda *a: calls.append(1) or real(*a)
    with_chunk = _forward(model, attn, kv, ops, stack, 3, prefill=20)
    assert with_chunk.shape[0] == 3 + 20 and not calls
    _forward(model, attn, kv, ops, stack, 3)
    assert calls == [1]
    # an int4 model has no kernel of the stack's: no plan, the loop
    model4 = _model("int4")
    for m in _linears(model4):
        m.max_rows = 64
    assert ds.DecodeStack.build(model4, attn, kv, ops).plan(2) is None
    # eager ops (--fused-ops off): no stack at all
    assert ds.DecodeStack.build(model, attn, kv, make_ops(False, torch.device("cpu"), torch.bfloat16)) is None


def test_a_bad_call_raises_and_leaves_the_process_usable():
    """The stack runs without the GIL; its checks come back as Python exceptions, before anything is
    written."""
    model = _kernel_model()
    attn, kv, ops, stack = _setup(model, "int8")
    weights, kinds = stack.plan(2)
    x = torch.zeros(2, CFG.hidden_size, dtype=torch.bfloat16)
    meta_args = (torch.zeros(2, dtype=torch.int64), model._rope_cos, model._rope_sin,
                 torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64),
                 torch.ones(2, dtype=torch.int64), CFG.num_heads, CFG.num_kv_heads, BS, 0.125, 1e-5, True,
                 2.0)
    before = [t.clone() for t in kv.k + kv.v]
    for bad in (weights[:-1], weights + [weights[0]]):
        with pytest.raises(RuntimeError, match="decode_stack: .* tensors where the kinds need"):
            stack.ext.decode_stack(x, bad, kinds, *meta_args)
    with pytest.raises(RuntimeError, match="unknown linear kind"):
        stack.ext.decode_stack(x, weights, [9] + kinds[1:], *meta_args)
    assert torch.equal(x, torch.zeros_like(x)) and all(torch.equal(a, b) for a,
                                                       b in zip(before, kv.k + kv.v, strict=True))
    assert _forward(model, attn, kv, ops, stack, 2).shape == (2, CFG.vocab_size)
