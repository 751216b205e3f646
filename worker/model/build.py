"""The loaded-model record and how a model is built on its device: device and dtype choice, weights put in
place.

Shared by the file loader (`worker.model.loader`) and the random test models (`worker.model.tiny_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.config import ModelConfig
from worker.kernels.cpu_features import has_fast_bf16
from worker.model.llama import LlamaModel
from worker.text.tokenizer import Tokenizer

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    model_id: str
    tokenizer_version: str
    max_context: int
    dtype: torch.dtype
    device: torch.device
    quantization: str = "none"  # the mode actually applied (see `worker.quant.weights`)
    weights: str = ""  # names the weights' bytes (`model_source.weights_digest`, or the random model's seed)
    version: str = ""  # the operator's version label (`--model-version`)

    @property
    def weights_id(self) -> str:
        """What the KV of a prompt depends on besides the tokenizer and layout: the weights, the quantization
        mode actually applied, the dtype and the version label (`worker.kvcache.tiers.pages.fingerprint`)."""
        return "|".join((self.weights, self.quantization, str(self.dtype), self.version))


def pick_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" or has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _DTYPES[dtype]


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """The model with uninitialized weights of `dtype` on `device` (tied weights tied), ready to be filled in.

    Built on the meta device, then given real storage by `torch.empty` per tensor: `Module.to_empty` calls
    `empty_like` on meta tensors, whose first call imports torch's decompositions and sympy (0.5 s of a
    start)."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                               device=device))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
           device: torch.device) -> LlamaModel:
    """tensors use HF names (model.layers.N.self_attn.q_proj.weight, ...)."""
    model = empty_model(cfg, dtype, device)

    def put(param: torch.Tensor, *names: str) -> None:
        src = torch.cat([tensors.pop(n) for n in names], dim=0) if len(names) > 1 else tensors.pop(names[0])
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"{names}: shape {tuple(src.shape)} != expected {tuple(param.shape)}")
        param.copy_(src)

    put(model.embed.weight, "model.embed_tokens.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.input_norm.weight, p + "input_layernorm.weight")
        put(layer.post_attn_norm.weight, p + "post_attention_layernorm.weight")
        put(layer.qkv.weight, *(p + f"self_attn.{x}_proj.weight" for x in "qkv"))
        put(layer.o.weight, p + "self_attn.o_proj.weight")
        put(layer.gate_up.weight, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        put(layer.down.weight, p + "mlp.down_proj.weight")
    put(model.norm.weight, "model.norm.weight")
    if not cfg.tie_word_embeddings:
        put(model.lm_head.weight, "lm_head.weight")
    model.eval()
    model.build_rope()
    return model
