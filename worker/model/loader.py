"""Load weights into `model.LlamaModel` from a GGUF file (dequantized) or a local HF folder, then quantize.

GGUF Q/K rows are un-permuted from llama.cpp's interleaved RoPE to the HF rotate-half layout.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from worker.config import ModelConfig
from worker.model.build import LoadedModel, build_model, pick_device, pick_dtype
from worker.model.gguf_dequant import dequantize
from worker.model.llama import activation_maxima
from worker.quant import w8a8 as smooth
from worker.quant import weights as quant
from worker.quant.packed import pack_model
from worker.text.gguf_index import read_index
from worker.text.model_source import ModelSource, default_model_path, hf_config, resolve, weights_digest
from worker.text.tokenizer import load_tokenizer

__all__ = ["LoadedModel", "default_model_path", "load_any", "load_model", "pick_device", "pick_dtype"]
log = logging.getLogger(__name__)

def load_model(spec: str | Path = "default", *, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, quantization: str = "none") -> LoadedModel:
    t0 = time.monotonic()
    src = resolve(spec)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    mode = quant.resolve_mode(quantization, dev)
    if src.kind == "gguf":
        cfg, tensors = _read_gguf(src)
    else:
        cfg, tensors = _read_hf(src)
    tok = load_tokenizer(src)
    model = build_model(cfg, tensors, dt, dev)
    quant.quantize_model(model, mode, calibration_ids=smooth.calibration_ids(tok) if mode == "w8a8" else None,
                         measure=activation_maxima)
    pack_model(model)  # bf16 on CPU: the remaining linear layers prepacked for oneDNN
    log.info("loaded %s (%s, %s, quantization %s%s) in %.1fs", src.model_id, dt, dev, mode,
             " from auto" if quantization == "auto" else "", time.monotonic() - t0)
    return LoadedModel(cfg, model, tok, src.model_id, tok.version, min(cfg.max_position, tok.max_context), dt,
                       dev, mode, weights_digest(src))


def load_any(spec: str, *, dtype: str | None = None, device: str | None = None,
             quantization: str = "none") -> LoadedModel:
    """`tiny-random` (see `worker.model.tiny_model`) or anything `load_model` understands.

    The random test model stays unquantized under `auto` (the quality gate means nothing for it)."""
    from worker.model import tiny_model

    if spec == tiny_model.TINY_SPEC:
        loaded = tiny_model.load_tiny_model(dtype=dtype or "float32", device=device)
        mode = "none" if quantization == "auto" else quant.resolve_mode(quantization, loaded.device)
        ids = smooth.calibration_ids(loaded.tokenizer) if mode == "w8a8" else None
        quant.quantize_model(loaded.model, mode, calibration_ids=ids, measure=activation_maxima)
        pack_model(loaded.model)
        loaded.quantization = mode
        return loaded
    return load_model(spec, dtype=dtype, device=device, quantization=quantization)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_config(md: dict) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in ("llama", "mistral"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (Llama family only)")

    def g(key: str, default=None):
        return md.get(f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", g("rope.dimension_count", hidden // heads)))
    scaling = None
    if g("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    return ModelConfig(
        vocab_size=int(g("vocab_size") or 0), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position=int(g("context_length", 2048)),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
    )


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _read_gguf(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    index = read_index(src.path)
    cfg = gguf_config(index.meta)
    tensors: dict[str, torch.Tensor] = {}
    for t, data in index.arrays(src.path):
        w = dequantize(data, t.qtype)
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, _ = name.split(".", 3)
            if kind not in _GGUF_NAMES:
                continue
            if kind == "attn_q":
                w = _unpermute(w, cfg.num_heads)
            elif kind == "attn_k":
                w = _unpermute(w, cfg.num_kv_heads)
            hf = f"model.layers.{idx}.{_GGUF_NAMES[kind]}.weight"
        else:
            continue
        tensors[hf] = w.contiguous()
    cfg.tie_word_embeddings = "lm_head.weight" not in tensors
    if not cfg.vocab_size:
        cfg.vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    return cfg, tensors


def _read_hf(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    c = hf_config(src.path)
    if c.get("model_type") not in ("llama", "mistral"):
        raise ValueError(f"unsupported model_type {c.get('model_type')!r} (Llama family only)")
    heads = int(c["num_attention_heads"])
    eos = c.get("eos_token_id")
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`
    rope = dict(c.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    cfg = ModelConfig(
        vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]), num_layers=int(c["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, max_position=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )
    files = sorted(src.path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src.path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return cfg, tensors
