"""On a CUDA device: greedy outputs equal the CPU reference in fp32, CUDA-graph decode equals eager decode,
and the backend rule picks Triton. `make test-gpu` runs these (they skip without CUDA).

Self-contained (no conftest fixtures): a lent GPU machine runs them with `--noconftest`. Without the default
model's package there, SWITCHYARD_TOKENIZER names a folder holding its tokenizer (docs/gpu.md).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from worker.config import EngineConfig, ModelConfig
from worker.engine.core import Engine
from worker.model.backends import choose_backend
from worker.model.tiny_model import load_tiny_model, random_model
from worker.protocol import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOKENIZER = os.environ.get("SWITCHYARD_TOKENIZER", "default")
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 40, 64, 100, 9)]


def _engine(loaded, **kw) -> Engine:
    return Engine(loaded, EngineConfig(kv_cache_bytes=256 << 20, max_num_seqs=16, **kw))


def _smollm_shape(vocab: int) -> ModelConfig:
    """The default model's shape (SmolLM2-135M: 30 layers, 9 query and 3 KV heads of 64), random weights."""
    return ModelConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, max_position=8192, tie_word_embeddings=True)


def test_auto_backend_on_cuda_is_triton_with_graphs():
    assert choose_backend("auto", torch.device("cuda"), 16) == "triton"  # flash-attn: not at 16-token pages
    with pytest.raises(ValueError, match="256"):
        choose_backend("flash_attn", torch.device("cuda"), 16)
    stats = _engine(load_tiny_model(device="cuda", tokenizer=TOKENIZER)).stats()
    assert stats.attention_backend == "triton" and stats.cuda_graphs


@pytest.mark.parametrize("shape", ["tiny", "smollm2-135m"])
def test_greedy_on_gpu_equals_cpu_reference_fp32(shape):
    def load(device: str):
        if shape == "tiny":
            return load_tiny_model(dtype="float32", device=device, tokenizer=TOKENIZER)
        tok = load_tiny_model(device="cpu", tokenizer=TOKENIZER).tokenizer
        return random_model(_smollm_shape(tok.vocab_size), dtype="float32", device=device, tokenizer=tok)

    cpu, gpu = load("cpu"), load("cuda")
    prompts = _prompts(cpu.config.vocab_size)
    want = _engine(cpu).generate(prompts, GREEDY)
    got = _engine(gpu).generate(prompts, GREEDY)
    assert got == want


def test_cuda_graph_decode_equals_eager():
    loaded = load_tiny_model(dtype="float32", device="cuda", tokenizer=TOKENIZER)
    graphs, eager = _engine(loaded), _engine(loaded, cuda_graphs="off")
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    prompts = _prompts(loaded.config.vocab_size, seed=3)
    assert graphs.generate(prompts, GREEDY) == eager.generate(prompts, GREEDY)


def test_graph_logits_match_eager_forward_bf16():
    """One decode step at a padded bucket (5 rows replay the 8-row graph) against the eager forward."""
    from worker.engine.runner import decode_inputs
    from worker.model.attention import BatchLayout
    from worker.model.llama import StepContext

    loaded = load_tiny_model(dtype="bfloat16", device="cuda", tokenizer=TOKENIZER)
    engine = _engine(loaded, spec_tokens=0)
    prompts = _prompts(loaded.config.vocab_size, seed=5)[:5]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the five prompts' prefill (and first tokens)
    batch = engine.scheduler.schedule()  # the next step: five decodes, their pages allocated
    assert len(batch.decodes) == 5 and not batch.prefills
    runner, seqs = engine.runner, batch.decodes
    inputs = decode_inputs(seqs, runner.bs)
    with torch.inference_mode():
        got = runner.graphs.run(inputs).clone()
        dev = runner.device
        lay = BatchLayout(runner.bs, torch.tensor(inputs.slots, device=dev), inputs.tables, inputs.lens, [],
                          [], [])
        ctx = StepContext(torch.tensor(inputs.positions, device=dev), torch.arange(len(seqs), device=dev),
                          runner.attn, runner.attn.prepare(lay, dev), runner.kv, runner.ops)
        want = runner.model(torch.tensor(inputs.ids, device=dev), ctx)
    assert runner.graphs.bucket(len(seqs)) == 8
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_seeded_sampling_on_gpu_is_reproducible():
    """Top-p/top-k sampling with penalties runs on the device (tensors on one device) and repeats under a
    seed."""
    loaded = load_tiny_model(dtype="float32", device="cuda", tokenizer=TOKENIZER)
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=42, ignore_eos=True,
                        presence_penalty=0.5, logprobs=True, top_logprobs=3)
    prompts = _prompts(loaded.config.vocab_size, seed=9)[:3]
    first = _engine(loaded).generate(prompts, sp)
    assert first == _engine(loaded).generate(prompts, sp)
    assert all(len(out) == 12 for out in first)


def test_int8_kv_pages_graph_decode_equals_eager():
    """--kv-dtype int8 on the Triton backend: CUDA-graph decode (the quantizing write captured) equals eager.
    Against the torch reference over the same pages: tests/worker/model/test_triton_kv_int8.py, on this
    device."""
    gpu = load_tiny_model(dtype="float32", device="cuda", tokenizer=TOKENIZER)
    prompts = _prompts(gpu.config.vocab_size, seed=4)
    graphs, eager = _engine(gpu, kv_dtype="int8"), _engine(gpu, kv_dtype="int8", cuda_graphs="off")
    assert graphs.kv_dtype == "int8" and graphs.runner.graphs is not None
    assert graphs.generate(prompts, GREEDY) == eager.generate(prompts, GREEDY)
