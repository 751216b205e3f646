"""The Triton backend over int8 KV pages: the quantizing write against `worker.kvcache.quant.write_int8`, and
decode/prefill/extend over int8 pages against the pure-torch reference reading the same pages.

On CPU the kernels run under Triton's interpreter (code for code equal there); with CUDA natively.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported

pytest.importorskip("triton")

from worker.kvcache import quant  # noqa: E402
from worker.kvcache.tensors import KVCache  # noqa: E402
from worker.model.attention import BatchLayout, TorchAttention  # noqa: E402
from worker.model.triton_backend import TritonAttention  # noqa: E402

pytestmark = pytest.mark.triton_kernels
PAGE = 16


class _Cfg:  # the fields KVCache reads
    def __init__(self, kvh: int, hd: int) -> None:
        self.num_kv_heads, self.head_dim, self.num_layers = kvh, hd, 1


def _same_codes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Code for code under the interpreter; natively a division may round one code the other way."""
    diff = (got.int() - want.int()).abs()
    assert diff.max().item() <= (0 if DEVICE.type == "cpu" else 1)
    assert (diff > 0).float().mean().item() <= 1e-3


def _drifting(n: int, kvh: int, hd: int, seed: int) -> torch.Tensor:
    """Rows whose magnitude drifts up and down, so appended rows grow their pages' scales."""
    g = torch.Generator().manual_seed(seed)
    gain = torch.exp(torch.randn(n, generator=g).cumsum(0) * 0.4)[:, None, None]
    return (torch.randn(n, kvh, hd, generator=g) * gain).to(DEVICE)


def test_int8_write_equals_torch_reference_with_growth_and_padded_rows():
    from worker.kernels.triton_kv_int8 import paged_kv_write_int8

    kvh, hd, num_pages = 3, 64, 8
    x = _drifting(40, kvh, hd, seed=3)
    # a 20-token chunk over two pages (page 5 whole, page 2 from its start), then single-token appends to
    # page 2 interleaved with a padded row and a second sequence's page 6, then a 6-token chunk finishing
    # page 2
    steps = [[5 * PAGE + i for i in range(16)] + [2 * PAGE + i for i in range(4)],
             [2 * PAGE + 4, -1, 6 * PAGE], [2 * PAGE + 5, 6 * PAGE + 1], [2 * PAGE + i for i in range(6, 12)]]
    ref = (torch.zeros(kvh, num_pages * PAGE, hd, dtype=torch.int8, device=DEVICE),
           torch.zeros(kvh, num_pages, device=DEVICE))
    tri = (ref[0].clone(), ref[1].clone(), ref[0].clone(), ref[1].clone())
    row, grew = 0, False
    for slots in steps:
        xs = x[row:row + len(slots)]
        row += len(slots)
        live = torch.tensor([s >= 0 for s in slots], device=DEVICE)
        sm = torch.tensor(slots, device=DEVICE)
        before = ref[1].clone()
        quant.write_int8(xs[live], ref[0], ref[1], sm[live], PAGE)
        grew |= bool(((ref[1] > before) & (before > 0)).any())
        paged_kv_write_int8(xs, xs * 2, tri[0], tri[2], tri[1], tri[3], sm, PAGE)
        _same_codes(tri[0], ref[0])
        assert torch.allclose(tri[1], ref[1], rtol=1e-6, atol=0)
        _same_codes(tri[2], ref[0])  # v = 2k: the same codes, twice the scales
        assert torch.allclose(tri[3], ref[1] * 2, rtol=1e-6, atol=0)
    assert grew, "the workload should grow some page's scale"
    assert tri[0][:, [p * PAGE + o for p in (0, 1, 3, 4, 7) for o in range(PAGE)]].abs().sum().item() == 0


def _layout(decode_ctx: list[int], chunks: list[tuple[int, int]], num_pages: int,
            rng: random.Random) -> BatchLayout:
    free = list(range(num_pages))
    rng.shuffle(free)

    def pages(ctx: int) -> list[int]:
        return [free.pop() for _ in range(-(-ctx // PAGE))]

    dec, pf = [pages(c) for c in decode_ctx], [pages(c) for _, c in chunks]
    slots = [t[(c - 1) // PAGE] * PAGE + (c - 1) % PAGE for t, c in zip(dec, decode_ctx, strict=True)]
    for t, (q, c) in zip(pf, chunks, strict=True):
        slots += [t[p // PAGE] * PAGE + p % PAGE for p in range(c - q, c)]
    return BatchLayout(PAGE, torch.tensor(slots, dtype=torch.int64, device=DEVICE), dec, decode_ctx, pf,
                       [q for q, _ in chunks], [c for _, c in chunks])


def _context(cache: KVCache, lay: BatchLayout, kvh: int, hd: int, seed: int) -> None:
    """Quantize a random context into every page the layout reads (before the step's own rows)."""
    torch.manual_seed(seed)
    for tables, lens in ((lay.decode_tables, lay.decode_ctx), (lay.prefill_tables, lay.prefill_ctx)):
        for t, c in zip(tables, lens, strict=True):
            slots = torch.tensor([t[p // PAGE] * PAGE + p % PAGE for p in range(c)], device=DEVICE)
            for x, codes, scales in ((torch.randn(c, kvh, hd), cache.k[0], cache.k_scale[0]),
                                     (torch.randn(c, kvh, hd), cache.v[0], cache.v_scale[0])):
                quant.write_int8(x.to(DEVICE), codes, scales, slots, PAGE)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 4e-2)])
def test_attention_over_int8_pages_matches_reference(dtype, tol):
    """Decodes (one at a page's first slot), a fresh prompt, an extend over a cached prefix and a chunk
    starting mid-page, in one step: the same outputs and the same pages as the torch reference over int8
    pages."""
    nh, kvh, hd, num_pages = 9, 3, 64, 64
    lay = _layout([1, 17, 40, 130], [(20, 20), (33, 97), (5, 40)], num_pages, random.Random(5))
    caches = [KVCache(_Cfg(kvh, hd), num_pages, PAGE, dtype, DEVICE, kv_dtype="int8") for _ in range(2)]
    for c in caches:
        _context(c, lay, kvh, hd, seed=9)
    t = lay.slot_mapping.shape[0]
    q, k, v = (torch.randn(t, n, hd, dtype=dtype, device=DEVICE) for n in (nh, kvh, kvh))
    ref = TorchAttention(nh, kvh, hd)  # no C++ kernels: the pure-torch reference
    want = ref.forward(0, q, k, v, caches[0], ref.prepare(lay, DEVICE))
    tri = TritonAttention(nh, kvh, hd)
    got = tri.forward(0, q, k, v, caches[1], tri.prepare(lay, DEVICE))
    _same_codes(caches[1].k[0], caches[0].k[0])
    _same_codes(caches[1].v[0], caches[0].v[0])
    assert torch.allclose(caches[1].k_scale[0], caches[0].k_scale[0], rtol=1e-6, atol=0)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol}"


@pytest.mark.heavy  # ~20 s under the interpreter: `make test-heavy` (and `make test-gpu` natively)
def test_engine_greedy_on_int8_pages_triton_equals_torch_reference():
    """The engine with --kv-dtype int8 (chunked prefill, a prefix-cache extend, decode): the Triton backend
    gives the torch reference's tokens, and reports int8 pages."""
    from worker.config import EngineConfig
    from worker.engine.core import Engine
    from worker.model.tiny_model import load_tiny_model
    from worker.protocol import SamplingParams

    loaded = load_tiny_model(dtype="float32", device=DEVICE,
                             tokenizer=os.environ.get("SWITCHYARD_TOKENIZER", "default"))
    rng = random.Random(12)
    shared = [rng.randrange(loaded.config.vocab_size) for _ in range(40)]
    prompts = [shared + [rng.randrange(loaded.config.vocab_size) for _ in range(n)] for n in (1, 9, 30)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(backend: str) -> tuple[list[list[int]], Engine]:
        eng = Engine(loaded, EngineConfig(attention_backend=backend, kv_dtype="int8",
                                          max_num_batched_tokens=32, kv_cache_bytes=16 << 20,
                                          cuda_graphs="off"))
        return [eng.generate([p], sp)[0] for p in prompts], eng

    want, _ = run("torch_reference")
    got, eng = run("triton")
    assert eng.kv_dtype == "int8" and eng.stats().cached_tokens > 0
    assert got == want
