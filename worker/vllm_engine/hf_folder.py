"""`python -m worker.vllm_engine.hf_folder MODEL OUT_DIR`: a GGUF model (`default`: the packaged SmolLM2) or
`tiny-random-vllm` as a plain Hugging Face folder (fp32 safetensors, tokenizer, chat template) that vLLM's
engine loads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from worker.config import ModelConfig
from worker.model.tiny_model import TINY_SEED, random_tensors
from worker.text.model_source import resolve

TINY_VLLM_SPEC = "tiny-random-vllm"


def write_hf_folder(spec: str, out: Path) -> Path:
    """Dequantize `spec`'s GGUF weights through transformers into `out` (replaced); returns `out`.
    `tiny-random-vllm`: a 2-layer Llama with seeded random weights, shaped for vLLM's CPU attention (head_dim
    64; 2 query and 2 KV heads, so tensor parallelism over 2 splits it)."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if spec == TINY_VLLM_SPEC:
        _write_tiny(tmp)
    else:
        _write_dequantized(spec, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a folder with config.json is whole: an interrupted run leaves only *.partial
    return out


def _write_tiny(tmp: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tokenizer = _gguf_tokenizer("default")
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=2, num_kv_heads=2, head_dim=64, max_position=8192, tie_word_embeddings=True,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, head_dim=cfg.head_dim,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.rms_norm_eps,
                         rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
                         eos_token_id=cfg.eos_token_id, bos_token_id=cfg.bos_token_id, torch_dtype="float32",
                         architectures=["LlamaForCausalLM"])
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    save_file(random_tensors(cfg, TINY_SEED), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)


def _gguf_tokenizer(spec: str):  # noqa: ANN202 - transformers' tokenizer class
    from transformers import AutoTokenizer

    src = resolve(spec)
    return AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)


def _write_dequantized(spec: str, tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    src = resolve(spec)
    if src.kind != "gguf":
        raise ValueError(f"{spec} is a Hugging Face folder already")
    folder, name = str(src.path.parent), src.path.name
    tokenizer = _gguf_tokenizer(spec)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: plain fp32 tensors
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # without the GGUF quantizer
    _, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected:
        raise ValueError(f"tensors the plain model has no place for: {unexpected[:4]}")
    model.generation_config = loaded.generation_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config_path = tmp / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)
    config_path.write_text(json.dumps(saved, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.vllm_engine.hf_folder",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("model", help=f"'default', a .gguf file or {TINY_VLLM_SPEC!r}")
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    print(write_hf_folder(args.model, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
