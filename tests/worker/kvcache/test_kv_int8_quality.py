"""8-bit KV quality gate and wiring: the default model's perplexity on the shipped text with int8 pages
against its model-dtype pages (the weights' gate text, `tests/data/quant_eval.txt`), `--kv-dtype` resolution,
the engine."""

from __future__ import annotations

import pytest
import torch

from bench.quant_decode import eval_ids, score
from config.cmd_worker import engine_config
from config.settings import WorkerSettings
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.model.kv_dtype import resolve_kv_dtype
from worker.model.loader import load_any, load_model
from worker.protocol import SamplingParams

# issue 30: within 0.5% of the model dtype's KV; measured x1.0019 on all the text, x1.0032 on its
PPL_GATE = 1.005
# first 1,024 tokens, top-1 96.8-97.1% (bf16, AMD EPYC)
AGREE = 0.95


@pytest.fixture(scope="module")
def smollm():
    return load_model("default", device="cpu", quantization="none")


@pytest.mark.heavy  # a quality gate: `make test-heavy` (its own CI step) keeps `make test` under 12 minutes
@pytest.mark.parametrize("tokens", [1024, None])
def test_perplexity_gate(smollm, tokens):
    """Every next token of the text (its first 1,024 tokens, then all 2,631) prefilled in one chunk through
    the engine: all attention reads int8 pages (the C++ kernels where built), against the same model with
    model-dtype pages."""
    ids = eval_ids(smollm)[:tokens]
    assert len(ids) >= 1000
    ref, got = score(smollm, ids, 4096), score(smollm, ids, 4096, kv_dtype="int8")
    ratio = got.perplexity / ref.perplexity
    agree = (got.top1 == ref.top1).float().mean().item()
    print(f"int8 KV ({smollm.dtype}, {len(ids)} tokens): ppl {got.perplexity:.3f} vs {ref.perplexity:.3f} "
          f"(x{ratio:.4f}), top-1 {agree:.3f}")
    assert abs(ratio - 1) <= PPL_GATE - 1, f"int8 KV perplexity x{ratio:.4f} misses the gate x{PPL_GATE}"
    assert AGREE < agree < 1.0  # < 1: the pages are quantized


def test_auto_resolution_and_refusals():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # auto keeps the model dtype: int8 pages change greedy answers (bench/greedy_agreement.py)
    assert resolve_kv_dtype(EngineConfig(kv_dtype="auto"), cpu)[0] == "model"
    assert resolve_kv_dtype(EngineConfig(kv_dtype="int8"), cpu) == ("int8", "asked")
    assert resolve_kv_dtype(EngineConfig(kv_dtype="auto", attention_backend="torch_reference"),
                            cpu)[0] == "model"
    assert resolve_kv_dtype(EngineConfig(kv_dtype="int8", attention_backend="torch_reference"),
                            cpu)[0] == "int8"
    assert resolve_kv_dtype(EngineConfig(kv_dtype="model"), cuda) == ("model", "asked")
    assert resolve_kv_dtype(EngineConfig(kv_dtype="int8", attention_backend="torch"), cuda)[0] == "int8"
    assert resolve_kv_dtype(EngineConfig(kv_dtype="auto", attention_backend="torch"), cuda)[0] == "model"
    with pytest.raises(ValueError, match="--kv-dtype fp8 is not supported"):
        EngineConfig(kv_dtype="fp8").validate()
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        EngineConfig(kv_dtype="int4").validate()
    # the worker flag reaches the engine
    assert engine_config(WorkerSettings(kv_dtype="int8")).kv_dtype == "int8"
    with pytest.raises(ValueError, match="--kv-dtype fp8"):
        engine_config(WorkerSettings(kv_dtype="fp8"))


@pytest.mark.parametrize("backend", ["torch", "torch_reference"])
def test_engine_serves_from_int8_pages_with_twice_the_tokens(backend):
    """The tiny model through the engine on int8 pages (C++ kernels, then the torch reference): greedy outputs
    like the model dtype's for a prompt, chunked prefill and a prefix-cache hit; the same budget, ~2x the
    tokens."""
    lm = load_any("tiny-random", dtype="float32", device="cpu")
    prompt = [(7 * i) % 200 + 3 for i in range(70)]
    outs, totals = [], []
    for kv_dtype in ("model", "int8"):
        eng = Engine(lm, EngineConfig(kv_cache_bytes=4 << 20, kv_dtype=kv_dtype, max_num_batched_tokens=32,
                                      attention_backend=backend))
        assert eng.runner.kv.kv_dtype == kv_dtype == eng.kv_dtype
        got = []
        for rid in ("a", "b"):  # "b" hits the prefix cache of "a"
            eng.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0.0))
            toks: list[int] = []
            while eng.has_work():
                toks += [t for o in eng.step() if o.rid == rid for t in o.new_tokens]
            got.append(toks)
        assert got[0] == got[1] and eng.stats().cached_tokens > 0
        outs.append(got[0])
        totals.append(eng.stats().kv_total_tokens)
    assert sum(a == b for a, b in zip(outs[0], outs[1], strict=True)) >= 10
    assert totals[1] / totals[0] >= 3.5  # fp32 model: 4 bytes an element against 1 (+ scales)
