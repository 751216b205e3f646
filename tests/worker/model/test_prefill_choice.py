"""The prefill attention choice (`worker.model.prefill_choice`): measured once per shape, fixed by the
environment, SDPA keeping the decode and write kernels, close to the C++ kernel on a mixed step, and reported
in stats."""

from __future__ import annotations

import pytest
import torch

from worker.config import EngineConfig, ModelConfig
from worker.engine.core import Engine
from worker.kernels.cpu import extension
from worker.kvcache.tensors import KVCache
from worker.model import prefill_choice
from worker.model.attention import BatchLayout
from worker.model.backends import make_backend
from worker.model.tiny_model import load_tiny_model

pytestmark = pytest.mark.skipif(extension() is None, reason="needs the C++ kernels")
CPU = torch.device("cpu")


def _cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=6,
                       num_kv_heads=2, head_dim=64, max_position=2048)


def _attn_and_cache(kv_dtype: str, pages: int = 64):
    cfg = _cfg()
    attn = make_backend("torch", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, CPU)
    return cfg, attn, KVCache(cfg, pages, 16, torch.bfloat16, CPU, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
@pytest.mark.parametrize("path", ["kernel", "sdpa"])
def test_the_environment_fixes_the_path(monkeypatch, kv_dtype, path):
    monkeypatch.setenv(prefill_choice.PATH_ENV, path)
    monkeypatch.setattr(prefill_choice, "_measure", lambda *a: pytest.fail("measured despite the override"))
    cfg, attn, kv = _attn_and_cache(kv_dtype)
    chosen = prefill_choice.choose_prefill(attn, cfg, kv)
    assert chosen.prefill_path == path
    if path == "kernel":
        assert chosen is attn
    else:  # prefill on SDPA; decode and the K/V write keep their kernels
        assert chosen.prefill_kernel is None and chosen.int8.prefill is None
        assert chosen.kernel is attn.kernel and chosen.kv_write is attn.kv_write
        assert chosen.int8.decode is attn.int8.decode and chosen.int8.write is attn.int8.write


def test_the_measurement_runs_once_per_shape(monkeypatch):
    monkeypatch.delenv(prefill_choice.PATH_ENV, raising=False)
    monkeypatch.setattr(prefill_choice, "_CHOSEN", {})
    cfg, attn, kv = _attn_and_cache("model")
    first = prefill_choice.choose_prefill(attn, cfg, kv)  # a real probe on scratch pages
    assert first.prefill_path in ("kernel", "sdpa")
    assert not kv.k[0].any(), "the probe wrote into the served cache"
    monkeypatch.setattr(prefill_choice, "_measure", lambda *a: pytest.fail("measured twice"))
    again = prefill_choice.choose_prefill(make_backend("torch", 6, 2, 64, 16, CPU), cfg, kv)
    assert again.prefill_path == first.prefill_path


def test_int8_pages_keep_the_kernel_unless_asked(monkeypatch):
    """SDPA reads int8 pages dequantized to the model dtype (0.5% perplexity): never chosen by measurement."""
    monkeypatch.delenv(prefill_choice.PATH_ENV, raising=False)
    monkeypatch.setattr(prefill_choice, "_measure", lambda *a: pytest.fail("int8 pages measured"))
    cfg, attn, kv = _attn_and_cache("int8")
    assert prefill_choice.choose_prefill(attn, cfg, kv).prefill_path == "kernel"


@pytest.mark.parametrize("kv_dtype,tol", [("model", 2e-2), ("int8", 2e-2)])
def test_sdpa_path_matches_the_kernel_on_a_mixed_step(kv_dtype, tol):
    """Two decode rows, a fresh prompt and a chunk over a cached prefix, in one step; bf16 (the int8 path
    reads the same quantized pages both ways)."""
    cfg, attn, kv = _attn_and_cache(kv_dtype)
    sdpa = prefill_choice.without_prefill_kernels(attn)
    g = torch.Generator().manual_seed(3)
    tables = [list(range(0, 4)), list(range(4, 8)), list(range(8, 12)), list(range(12, 20))]
    ctxs, q_lens = [37, 50, 40, 120], [1, 1, 40, 24]
    full = [t[p // 16] * 16 + p % 16 for t, c in zip(tables, ctxs, strict=True) for p in range(c)]

    def rand(n: int, h: int) -> torch.Tensor:
        return torch.randn(n, h, 64, generator=g).to(torch.bfloat16)

    with torch.inference_mode():
        attn.forward(0, rand(len(full), 6), rand(len(full), 2), rand(len(full), 2), kv,
                     attn.prepare(BatchLayout(16, torch.tensor(full), [], [], tables, ctxs, ctxs), CPU))
        slots = [t[p // 16] * 16 + p % 16 for t, c, q in zip(tables, ctxs, q_lens, strict=True)
                 for p in range(c - q, c)]
        lay = BatchLayout(16, torch.tensor(slots), tables[:2], ctxs[:2], tables[2:], q_lens[2:], ctxs[2:])
        n = sum(q_lens)
        q, k, v = rand(n, 6), rand(n, 2), rand(n, 2)
        want = attn.forward(0, q, k, v, kv, attn.prepare(lay, CPU)).float()
        got = sdpa.forward(0, q, k, v, kv, sdpa.prepare(lay, CPU)).float()
    assert got.shape == want.shape == (n, 6 * 64)
    assert (got - want).abs().max().item() < tol


def test_engine_stats_name_the_prefill_path(monkeypatch):
    monkeypatch.setenv(prefill_choice.PATH_ENV, "sdpa")
    engine = Engine(load_tiny_model(), EngineConfig(kv_cache_bytes=8 << 20))
    assert engine.stats().prefill_attention == "sdpa"


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_an_unknown_path_is_refused(monkeypatch, kv_dtype):
    monkeypatch.setenv(prefill_choice.PATH_ENV, "flash")
    cfg, attn, kv = _attn_and_cache(kv_dtype)
    with pytest.raises(ValueError, match="SWITCHYARD_PREFILL_ATTENTION='flash'"):
        prefill_choice.choose_prefill(attn, cfg, kv)
