"""The `tiny-random` model: a 2-layer Llama with seeded random weights and the default model's tokenizer.

Loads in about a second and gives the same tokens in every process, for tests and development.
"""

from __future__ import annotations

import torch

from worker.config import ModelConfig
from worker.model.build import LoadedModel, build_model, empty_model, pick_device, pick_dtype
from worker.model.llama import LlamaModel
from worker.text.tokenizer import Tokenizer, load_tokenizer

TINY_SPEC = "tiny-random"
TINY_SEED = 1234


def tiny_config(vocab_size: int, eos_token_id: int | None, bos_token_id: int | None) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position=8192, tie_word_embeddings=True,
                       eos_token_id=eos_token_id, bos_token_id=bos_token_id)


def random_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h),
                                  "model.norm.weight": torch.ones(h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
        t[p + "self_attn.q_proj.weight"] = rnd(cfg.num_heads * hd, h)
        t[p + "self_attn.k_proj.weight"] = rnd(cfg.num_kv_heads * hd, h)
        t[p + "self_attn.v_proj.weight"] = rnd(cfg.num_kv_heads * hd, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, cfg.num_heads * hd)
        t[p + "mlp.gate_proj.weight"] = rnd(i, h)
        t[p + "mlp.up_proj.weight"] = rnd(i, h)
        t[p + "mlp.down_proj.weight"] = rnd(h, i)
    return t


def load_tiny_model(*, dtype: str | torch.dtype | None = "float32", device: str | torch.device | None = None,
                    seed: int = TINY_SEED, tokenizer: str = "default") -> LoadedModel:
    tok = load_tokenizer(tokenizer)
    cfg = tiny_config(tok.vocab_size, tok.eos_token_id, tok.bos_token_id)
    return random_model(cfg, dtype=dtype, device=device, seed=seed, tokenizer=tok)


def random_model(cfg: ModelConfig, *, dtype: str | torch.dtype | None = "float32",
                 device: str | torch.device | None = None, seed: int = TINY_SEED,
                 tokenizer: str | Tokenizer = "default", on_device: bool = False) -> LoadedModel:
    """A model of any Llama shape with seeded random weights (0.2 scale: peaked logits, so greedy tokens are
    stable).

    The weights are drawn on the CPU, so every device gets the same model; `on_device` draws them on the
    device instead (large shapes for benchmarks: fast, but other numbers than the CPU's)."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if not on_device:
        model = build_model(cfg, random_tensors(cfg, seed), dt, dev)
    else:
        model = _build_on_device(cfg, dt, dev, seed)
    spec = TINY_SPEC if cfg.hidden_size == 64 else f"random-{cfg.num_layers}x{cfg.hidden_size}"
    weights = f"random:{seed}:{'device' if on_device else 'cpu'}:{cfg}"  # the seed and shape name the weights
    return LoadedModel(cfg, model, tok, spec, tok.version, min(cfg.max_position, tok.max_context), dt, dev,
                       weights=weights)


def _build_on_device(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> LlamaModel:
    model = empty_model(cfg, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:  # std 1/sqrt(fan_in): activations keep their scale through any depth
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    model.eval()
    model.build_rope()
    return model

