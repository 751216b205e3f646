"""Weight-only int8/int4 quantization: the quality gate on a fixed 2,600-token text, loading, bad modes.

The gate scores every next token of `tests/data/quant_eval.txt` through the engine's paged prefill
(one chunk) with the default model in bf16 (fp32 on CPUs without fast bf16) and its int8/int4/w8a8/fp8 copies
(fp8 through its CPU emulation, `worker.quant.fp8`: the numerics of the CUDA path).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.quant_decode import eval_ids, quantized, score
from worker.config import EngineConfig
from worker.engine.debug import DebugEngine
from worker.model.loader import load_any, load_model
from worker.protocol import SamplingParams
from worker.quant import calibrate as cal
from worker.quant import fp8
from worker.quant import weights as quant

GATE = {"int8": 1.01, "int4": 1.05, "w8a8": 1.01, "fp8": 1.035}  # w8a8: int8 weights, so int8's gate
# fp8 (e4m3: 3 mantissa bits) measured x1.027 and 89.9% top-1 (its weights alone x1.015, its per-token
# activations alone x1.007): int8's gate is out of its reach on this 135M model
AGREE = {"fp8": 0.88}  # top-1 agreement with the unquantized model; others 0.9


@pytest.fixture(scope="module")
def base():
    return load_model("default", device="cpu", quantization="none")


@pytest.fixture(scope="module")
def reference(base):
    ids = eval_ids(base)
    assert len(ids) >= 2000
    return ids, score(base, ids, 4096)


@pytest.mark.heavy  # quality gate / default-model end to end: `make test-heavy`, its own CI step
@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8", "fp8"])
def test_perplexity_gate(base, reference, mode):
    ids, ref = reference
    lm = quantized(base, mode)  # quantize_model directly: fp8 runs emulated here (resolve_mode refuses CPUs)
    assert isinstance(lm.model.layers[0].gate_up, fp8.Fp8Linear if mode == "fp8" else quant.QuantLinear)
    got = score(lm, ids, 4096)
    ratio = got.perplexity / ref.perplexity
    agree = (got.top1 == ref.top1).float().mean().item()
    print(f"{mode}: ppl {got.perplexity:.3f} vs {ref.perplexity:.3f} (x{ratio:.4f}), top-1 agreement "
          f"{agree:.3f}")
    assert ratio <= GATE[mode], f"{mode} perplexity x{ratio:.4f} exceeds the gate x{GATE[mode]}"
    assert agree > AGREE.get(mode, 0.9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_packed_kernel_matches_dequantized_path(mode, dtype):
    torch.manual_seed(0)
    w = torch.randn(192, 128, dtype=dtype) * 0.05
    lin = quant.QuantLinear(w, mode)
    # fp32: the kernel may take bf16 activations (the faster here), never changing the dtype out
    cal.calibrate(lin)
    assert lin.kernel_dtype in ((dtype,) if dtype == torch.bfloat16 else (torch.float32, torch.bfloat16))
    lin.max_rows = quant.PACKED_MAX_ROWS
    x = torch.randn(quant.PACKED_MAX_ROWS + 8, 128, dtype=dtype)
    assert lin(x[:4]).dtype == dtype
    big = lin(x).float()  # dequantize + GEMM
    small = torch.cat([lin(x[i:i + 4]) for i in range(0, x.shape[0], 4)]).float()  # packed kernel
    assert ((big - small).norm() / big.norm()).item() < 0.01
    exact = x.float() @ w.float().t()
    assert ((big - exact).norm() / exact.norm()).item() < (0.02 if mode == "int8" else 0.15)


def _first_logits(loaded, prompt: list[int]) -> torch.Tensor:
    engine = DebugEngine(loaded, EngineConfig(kv_cache_bytes=16 << 20, max_num_batched_tokens=64))
    capture: list = []
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_work():
        engine.step(capture=capture)
    assert engine.stats().quantization == loaded.quantization
    return torch.cat([lg for _, _, lg in capture])


@pytest.mark.heavy  # quality gate / default-model end to end: `make test-heavy`, its own CI step
def test_gguf_loads_quantized(base):
    loaded = load_model("default", device="cpu", quantization="int4")
    assert loaded.quantization == "int4"
    assert loaded.model.layers[3].qkv.qweight.dtype == torch.uint8
    assert isinstance(loaded.model.embed, quant.QuantEmbedding)
    prompt = eval_ids(base)[:40]
    got, want = _first_logits(loaded, prompt), _first_logits(quantized(base, "int4"), prompt)
    assert torch.allclose(got, want, atol=1e-3, rtol=0)
    assert quant.weight_bytes(loaded.model) < 0.45 * quant.weight_bytes(base.model)


def test_hf_folder_loads_quantized(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.text.tokenizer import load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer("default")
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path, safe_serialization=True)
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    ref = load_model(str(tmp_path), dtype="float32", device="cpu")
    prompt = [(i * 7919) % 40000 + 3 for i in range(40)]
    want = _first_logits(ref, prompt)
    for mode in ("int8", "int4", "w8a8"):
        loaded = load_model(str(tmp_path), dtype="float32", device="cpu", quantization=mode)
        assert loaded.quantization == mode and isinstance(loaded.model.lm_head, quant.QuantLinear)
        assert isinstance(loaded.model.embed, torch.nn.Embedding)  # untied: the table stays as loaded
        got = _first_logits(loaded, prompt)
        assert ((got - want).norm() / want.norm()).item() < (0.2 if mode == "int4" else 0.05)


def test_unknown_mode_is_a_startup_error():
    with pytest.raises(ValueError, match="none, int8, int4, w8a8, fp8, auto"):
        load_any("tiny-random", quantization="int3")
    with pytest.raises(ValueError, match="none, int8, int4, w8a8, fp8, auto"):
        EngineConfig(quantization="fp4").validate()
    with pytest.raises(ValueError, match="fp8 needs a CUDA device"):  # a startup error on CPU too
        load_any("tiny-random", quantization="fp8")
    with pytest.raises(ValueError, match="'none' or 'auto'"):
        quant.resolve_mode("int8", torch.device("meta"))
    assert load_any("tiny-random", quantization="auto").quantization == "none"
    proc = subprocess.run([sys.executable, "-m", "config.cli", "worker", "--model", "tiny-random",
                           "--quantization", "int3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "int3" in proc.stderr and "'none', 'int8', 'int4', 'w8a8', 'fp8', 'auto'" in proc.stderr


def test_mode_from_env_and_toml(monkeypatch, tmp_path):
    from config.cmd_worker import engine_config
    from config.settings import load_settings

    monkeypatch.setenv("SWITCHYARD_WORKER__QUANTIZATION", "int4")
    assert engine_config(load_settings(None, {}).worker).quantization == "int4"
    monkeypatch.delenv("SWITCHYARD_WORKER__QUANTIZATION")
    toml = tmp_path / "w.toml"
    toml.write_text('[worker]\nquantization = "int8"\n')
    assert load_settings(str(toml), {}).worker.quantization == "int8"
    toml.write_text('[worker]\nquantization = "int3"\n')
    with pytest.raises(ValueError, match="'int8'"):
        load_settings(str(toml), {})
