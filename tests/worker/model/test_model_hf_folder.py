"""Loading a local Hugging Face folder (safetensors + config.json + tokenizer), incl. Llama-3 rope scaling.

A small random LlamaForCausalLM with `rope_type: llama3` is saved with
`save_pretrained` beside the default model's tokenizer files; our loader must
reproduce transformers' logits for a long-enough prompt that the scaled
frequencies matter, through the engine (chunked prefill + decode).
"""

from __future__ import annotations

import json

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.debug import DebugEngine, pages_idle
from worker.model.loader import load_model
from worker.protocol import SamplingParams
from worker.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = load_tokenizer("default")
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                      rope_theta=500000.0)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama3")
    model.save_pretrained(path, safe_serialization=True)
    tok.hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}))
    return path, model


def test_hf_folder_logits_match_transformers(hf_folder):
    path, ref = hf_folder
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.rope_scaling and loaded.model_id == path.name
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    engine = DebugEngine(loaded, EngineConfig(kv_cache_bytes=16 << 20, max_num_batched_tokens=64))
    prompt = [(i * 7919) % 40000 + 3 for i in range(150)]
    capture: list = []
    engine.add_request("a", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    out: list[int] = []
    while engine.has_work():
        for o in engine.step(capture=capture):
            out.extend(o.new_tokens)
    rows = {}
    for _, pos, lg in capture:
        for j in range(lg.shape[0]):
            rows[pos + j] = lg[j]
    full = prompt + out
    with torch.inference_mode():
        expect = ref(torch.tensor([full])).logits[0, :-1].float()
    mine = torch.stack([rows[p] for p in range(len(full) - 1)])
    assert (mine - expect).abs().max().item() < 2e-3
    assert pages_idle(engine)
