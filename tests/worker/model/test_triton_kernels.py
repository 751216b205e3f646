"""The Triton attention backend against the pure-torch reference: K/V write, paged decode, prefill and extend.

On CPU the kernels run under Triton's interpreter (small shapes keep it fast); with CUDA they run natively.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

pytest.importorskip("triton")

from worker.kvcache.tensors import KVCache  # noqa: E402
from worker.model.attention import BatchLayout, TorchAttention  # noqa: E402
from worker.model.triton_backend import TritonAttention  # noqa: E402

pytestmark = pytest.mark.triton_kernels


class _Cfg:  # the fields KVCache reads
    def __init__(self, kvh: int, hd: int, layers: int = 1) -> None:
        self.num_kv_heads, self.head_dim, self.num_layers = kvh, hd, layers


def _layout(page: int, num_pages: int, decode_ctx: list[int], chunks: list[tuple[int, int]],
            rng: random.Random) -> tuple[BatchLayout, int]:
    """Random distinct pages per sequence; chunks are (q_len, ctx_len). Returns the layout and its token
    count."""
    free = list(range(num_pages))
    rng.shuffle(free)

    def pages(ctx: int) -> list[int]:
        return [free.pop() for _ in range(-(-ctx // page))]

    dec_tables = [pages(c) for c in decode_ctx]
    pf_tables = [pages(c) for _, c in chunks]
    slots = [t[(c - 1) // page] * page + (c - 1) % page for t, c in zip(dec_tables, decode_ctx, strict=True)]
    for t, (q, c) in zip(pf_tables, chunks, strict=True):
        slots += [t[p // page] * page + p % page for p in range(c - q, c)]
    lay = BatchLayout(page, torch.tensor(slots, dtype=torch.int64, device=DEVICE), dec_tables, decode_ctx,
                      pf_tables, [q for q, _ in chunks], [c for _, c in chunks])
    return lay, len(slots)


def _compare(nh: int, kvh: int, hd: int, decode_ctx: list[int], chunks: list[tuple[int, int]],
             dtype: torch.dtype, tol: float, page: int = 16, seed: int = 0) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_pages = 64
    lay, t = _layout(page, num_pages, decode_ctx, chunks, rng)
    caches = [KVCache(_Cfg(kvh, hd), num_pages, page, dtype, DEVICE) for _ in range(2)]
    for c in caches:  # the same random context in both caches (positions before each chunk's new tokens)
        torch.manual_seed(seed + 1)
        c.k[0].copy_(torch.randn(c.k[0].shape))
        c.v[0].copy_(torch.randn(c.v[0].shape))
    q = torch.randn(t, nh, hd, dtype=dtype, device=DEVICE)
    k = torch.randn(t, kvh, hd, dtype=dtype, device=DEVICE)
    v = torch.randn(t, kvh, hd, dtype=dtype, device=DEVICE)
    ref = TorchAttention(nh, kvh, hd)  # no C++ kernels: the pure-torch reference
    want = ref.forward(0, q, k, v, caches[0], ref.prepare(lay, DEVICE))
    tri = TritonAttention(nh, kvh, hd)
    got = tri.forward(0, q, k, v, caches[1], tri.prepare(lay, DEVICE))
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol}"


@pytest.mark.parametrize("nh,kvh", [(9, 3), (4, 4), (8, 2)])
def test_decode_matches_reference_gqa(nh, kvh):
    _compare(nh, kvh, 64, [1, 15, 16, 17, 130], [], torch.float32, 1e-5)


def test_prefill_fresh_and_extend_over_cached_prefix():
    # a fresh prompt (ctx == q), an extend chunk over a cached prefix, and a chunk that starts mid-page
    _compare(9, 3, 64, [], [(20, 20), (33, 97), (5, 40)], torch.float32, 1e-5)


def test_mixed_step_decodes_and_chunks_in_one_forward():
    _compare(6, 2, 32, [3, 64, 65], [(70, 70), (1, 50)], torch.float32, 1e-5)


def test_bf16_within_rounding_and_other_page_size():
    _compare(9, 3, 64, [9, 40], [(24, 56)], torch.bfloat16, 3e-2, page=32)


def test_kv_write_skips_padded_rows():
    from worker.kernels.triton_attention import paged_kv_write

    kc = torch.zeros(2, 32, 16, device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 16, device=DEVICE)
    v = torch.randn(3, 2, 16, device=DEVICE)
    paged_kv_write(k, v, kc, vc, torch.tensor([5, -1, 30], device=DEVICE))
    assert torch.equal(kc[:, 5], k[0]) and torch.equal(vc[:, 30], v[2])
    assert kc.abs().sum(dim=(0, 2)).nonzero().flatten().tolist() == [5, 30]  # row 1 (slot -1) wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,kvh", [(9, 3), (4, 4)])
def test_rope_and_kv_write_in_one_kernel_equal_the_two(dtype, nh, kvh):
    """`paged_rope_kv_write` (what `TritonOps.attend` runs on model-dtype pages) gives the bits of TritonOps'
    RoPE followed by `paged_kv_write`: q and k rotated in place, k and v in their slots, a padded row (-1)
    skipped."""
    from worker.kernels.layer_ops import Rope
    from worker.kernels.triton_attention import paged_kv_write, paged_rope_kv_write
    from worker.kernels.triton_ops import TritonOps

    g = torch.Generator().manual_seed(nh)
    hd, t = 64, 4
    qkv = torch.randn(t, nh + 2 * kvh, hd, generator=g).to(dtype).to(DEVICE)
    cos = torch.rand(64, hd // 2, generator=g).to(DEVICE)
    sin = torch.rand(64, hd // 2, generator=g).to(DEVICE)
    pos, slots = torch.tensor([0, 63, 17, 5], device=DEVICE), torch.tensor([7, -1, 40, 3], device=DEVICE)
    caches = [torch.zeros(kvh, 48, hd, dtype=dtype, device=DEVICE) for _ in range(4)]
    want = qkv.clone()
    TritonOps().rope(want, nh + kvh, Rope(pos, cos, sin))
    paged_kv_write(want[:, nh:nh + kvh], want[:, nh + kvh:], caches[0], caches[1], slots)
    got = qkv.clone()
    paged_rope_kv_write(got, nh, pos, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(got, want) and not torch.equal(got[:, :nh], qkv[:, :nh])
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].abs().sum(dim=(0, 2)).nonzero().flatten().tolist() == [3, 7, 40]


def test_triton_ops_attend_fuses_only_where_the_bits_match():
    """TritonOps.attend on the Triton backend (a mixed step, model-dtype pages): the fused kernel's output and
    pages equal the RoPE-then-forward path's; int8 pages take that path."""
    from worker.kernels.layer_ops import EagerOps, Rope
    from worker.kernels.triton_ops import TritonOps

    nh, kvh, hd, page = 6, 2, 32, 16
    lay, t = _layout(page, 32, [3, 40], [(20, 20)], random.Random(5))
    tri, ops = TritonAttention(nh, kvh, hd), TritonOps()
    rope = Rope(torch.randint(0, 64, (t,), device=DEVICE), torch.rand(64, hd // 2, device=DEVICE),
                torch.rand(64, hd // 2, device=DEVICE))
    qkv = torch.randn(t, nh + 2 * kvh, hd, device=DEVICE)
    caches = [KVCache(_Cfg(kvh, hd), 32, page, torch.float32, DEVICE) for _ in range(2)]
    meta = tri.prepare(lay, DEVICE)
    calls = []
    tri.forward_rope = lambda *a, real=tri.forward_rope: calls.append(1) or real(*a)
    got = ops.attend(tri, 0, qkv.clone(), nh, rope, caches[0], meta)
    want = EagerOps.attend(ops, tri, 0, qkv.clone(), nh, rope, caches[1], meta)
    assert calls == [1] and torch.equal(got, want)
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    int8 = KVCache(_Cfg(kvh, hd), 32, page, torch.float32, DEVICE, kv_dtype="int8")
    ops.attend(tri, 0, qkv.clone(), nh, rope, int8, meta)
    assert calls == [1]


def test_decode_padded_row_gives_zeros():
    from worker.kernels.triton_attention import paged_decode

    kc = torch.randn(1, 32, 16, device=DEVICE)
    q = torch.randn(2, 2, 16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    tables = torch.tensor([[0, 1], [0, 0]], dtype=torch.int32, device=DEVICE)
    paged_decode(q, kc, kc, tables, torch.tensor([20, 0], dtype=torch.int32, device=DEVICE), 16, 0.25, out)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out[0]).all()


def test_engine_greedy_with_triton_equals_torch_backend():
    """The whole engine (chunked prefill, prefix-cache extend, decode) on the Triton backend: the same
    tokens."""
    from worker.config import EngineConfig
    from worker.engine.core import Engine
    from worker.model.tiny_model import load_tiny_model
    from worker.protocol import SamplingParams

    loaded = load_tiny_model(dtype="float32", device=DEVICE, tokenizer=os.environ.get("SWITCHYARD_TOKENIZER",
                                                                                      "default"))
    rng = random.Random(11)
    # a cached prefix for the later prompts
    shared = [rng.randrange(loaded.config.vocab_size) for _ in range(40)]
    prompts = [shared + [rng.randrange(loaded.config.vocab_size) for _ in range(n)] for n in (1, 9, 30)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(backend: str) -> tuple[list[list[int]], Engine]:
        eng = Engine(loaded, EngineConfig(attention_backend=backend, max_num_batched_tokens=32,
                                          kv_cache_bytes=16 << 20, cuda_graphs="off"))
        return [eng.generate([p], sp)[0] for p in prompts], eng

    want, _ = run("torch_reference")
    got, eng = run("triton")
    assert eng.stats().attention_backend == "triton"
    assert eng.stats().cached_tokens > 0  # later prompts extended a cached prefix
    assert got == want


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_ops_match_eager_ops(dtype, tol):
    from worker.kernels.layer_ops import EagerOps, Rope
    from worker.kernels.triton_ops import TritonOps

    torch.manual_seed(0)
    eager, fused = EagerOps(), TritonOps()
    t, nh, kvh, hd, hidden, inter = 5, 9, 3, 64, 96, 80
    cos, sin = torch.rand(64, hd // 2, device=DEVICE), torch.rand(64, hd // 2, device=DEVICE)
    pos = torch.tensor([0, 7, 3, 63, 20], device=DEVICE)
    qkv = torch.randn(t, nh + 2 * kvh, hd, dtype=dtype, device=DEVICE)
    want = eager.rope(qkv, nh + kvh, eager.prepare_rope(Rope(pos, cos, sin), dtype))
    rotated = qkv.clone()
    got = fused.rope(rotated, nh + kvh, fused.prepare_rope(Rope(pos, cos, sin), dtype))
    assert _close(got, want, tol)
    assert torch.equal(rotated[:, nh + kvh:], qkv[:, nh + kvh:])  # v untouched

    x = torch.randn(t, hidden, dtype=dtype, device=DEVICE)
    res = torch.randn(t, hidden, dtype=dtype, device=DEVICE)
    w = torch.rand(hidden, dtype=dtype, device=DEVICE)
    assert _close(fused.rms_norm(x, w, 1e-5), eager.rms_norm(x, w, 1e-5), tol)
    xe, xf = x.clone(), x.clone()
    want, got = eager.add_rms_norm_(xe, res, w, 1e-5), fused.add_rms_norm_(xf, res, w, 1e-5)
    # the residual stream, updated in place the same way (bf16: within one rounding step; the interpreter's
    # fp32 -> bf16 cast truncates where CUDA rounds to nearest)
    assert torch.allclose(xe.float(), xf.float(), rtol=0 if dtype == torch.float32 else 2 ** -7, atol=0)
    assert _close(got, want, tol)

    gu = torch.randn(t, 2 * inter, dtype=dtype, device=DEVICE)
    assert _close(fused.silu_mul(gu), eager.silu_mul(gu), tol)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Max abs error within tol of the reference's magnitude (bf16 rounds at about 2^-8 of it)."""
    return (got.float() - want.float()).abs().max().item() <= tol * max(1.0, want.float().abs().max().item())


@pytest.mark.parametrize("splits", [2, 3, 16])
def test_split_context_decode_equals_one_pass(splits):
    """Flash-decoding: the context divided among programs (some empty), merged, equals one pass; padded rows
    stay 0."""
    from worker.kernels.triton_attention import paged_decode

    torch.manual_seed(splits)
    kc, vc = torch.randn(3, 64 * 16, 64, device=DEVICE), torch.randn(3, 64 * 16, 64, device=DEVICE)
    q = torch.randn(4, 9, 64, device=DEVICE)
    tables = torch.randperm(64, device=DEVICE)[:40].view(4, 10).to(torch.int32)
    lens = torch.tensor([1, 100, 160, 0], dtype=torch.int32, device=DEVICE)
    one = paged_decode(q, kc, vc, tables, lens, 16, 0.125, torch.empty_like(q), splits=1)
    split = paged_decode(q, kc, vc, tables, lens, 16, 0.125, torch.full_like(q, float("nan")), splits=splits)
    assert (split - one).abs().max().item() <= 1e-5
    assert torch.equal(split[3], torch.zeros_like(split[3]))


def test_fp8_row_quantization_kernel_equals_torch():
    """The fused activation quantization gives `worker.quant.fp8`'s scales, and on CUDA its codes, bit for
    bit."""
    from worker.kernels.triton_ops import quantize_rows_fp8
    from worker.quant import fp8

    torch.manual_seed(0)
    x = torch.randn(5, 96, device=DEVICE) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 7.0], device=DEVICE)[:, None]
    for dt in (torch.float32, torch.bfloat16):
        q, s = quantize_rows_fp8(x.to(dt), fp8.FP8_MAX, fp8.MIN_SCALE)
        q_ref, s_ref = fp8.quantize_rows_fp8(x.to(dt))
        assert torch.equal(s, s_ref)
        # the interpreter's fp32 -> e4m3 cast is wrong (124.3 becomes 64, not 128): codes are checked on CUDA
        if DEVICE.type == "cuda":
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
