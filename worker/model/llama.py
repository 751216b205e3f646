"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral) over the paged KV cache.

One forward runs a whole engine step (decodes and prefill chunks flattened together),
with fused Q/K/V and gate/up projections and logits only for the rows that sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from worker.config import LAYER_LINEARS, ModelConfig
from worker.kernels.layer_ops import EagerOps, Rope
from worker.kvcache.tensors import KVCache
from worker.model.attention import BatchLayout, FlashAttention, FlashMeta, TorchAttention, TorchMeta


class LayerStack(Protocol):
    """Every decoder layer of the steps it covers in one call (`worker.model.decode_stack.DecodeStack` on
    CPU)."""

    def covers(self, meta: object, rows: int) -> bool: ...

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: object) -> torch.Tensor: ...


@dataclass(slots=True)
class StepContext:
    """One step's inputs besides the token ids: positions, rows that need logits, the attention state."""

    positions: torch.Tensor  # [T] int64
    logits_rows: torch.Tensor | None  # [n] rows that need logits
    attn: TorchAttention | FlashAttention
    meta: TorchMeta | FlashMeta  # the backend's metadata for this step
    kv: KVCache
    ops: EagerOps  # the layer's elementwise ops: eager (reference) or fused (`worker.kernels.layer_ops`)
    stack: LayerStack | None = None  # decode-only steps' layers in one C++ call where it covers them (CPU)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor, low, high = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates low precision in fp32 and rounds once: one pass instead of the
        # seven of HF's formula (fp32 copy, pow, mean, rsqrt, mul, cast, weight mul), and closer to fp32
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, hd
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv = nn.Linear(h, (self.nh + 2 * self.kvh) * hd, bias=False)
        self.o = nn.Linear(self.nh * hd, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.index = index

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope: Rope,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] is the residual stream (updated in place, or a new tensor where the ops fuse the add
        into a projection); `pending` is the previous layer's MLP output, added in the same pass as this
        layer's input norm (one kernel fewer per layer). Returns x and this layer's MLP output, not yet
        added."""
        nh, kvh, hd, ops = self.nh, self.kvh, self.hd, ctx.ops
        x, qkv = ops.norm_linear(x, pending, self.input_norm, self.qkv)
        attn_out = ops.attend(ctx.attn, self.index, qkv.view(x.shape[0], nh + 2 * kvh, hd), nh, rope, ctx.kv,
                              ctx.meta)
        return ops.norm_mlp(x, self.o(attn_out), self.post_attn_norm, self.gate_up, self.down)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # no random init: weights are copied in after (nn.Embedding's own init on a meta device imported
        # torch._dynamo, 2 s of a worker's start)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.requires_grad_(False)
        self._rope_cos: torch.Tensor | None = None
        self._rope_sin: torch.Tensor | None = None

    def build_rope(self) -> None:
        """Precompute cos/sin [max_position, head_dim/2] in fp32 on the model's device (call after .to())."""
        dev = self.embed.weight.device
        inv = rope_inv_freq(self.cfg).to(dev)
        pos = torch.arange(self.cfg.max_position, device=dev, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        self._rope_cos, self._rope_sin = freqs.cos(), freqs.sin()

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """input_ids: [T]. Returns fp32 logits [n, vocab] of `ctx.logits_rows`, None when there are none."""
        if self._rope_cos is None:
            self.build_rope()
        x = self.embed(input_ids)
        if ctx.stack is not None and ctx.stack.covers(ctx.meta, x.shape[0]):
            x = ctx.stack.run(x, ctx.positions, ctx.meta)
        else:
            rope = ctx.ops.prepare_rope(Rope(ctx.positions, self._rope_cos, self._rope_sin), x.dtype)
            pending = None
            for layer in self.layers:
                x, pending = layer(x, pending, rope, ctx)
            if pending is not None:
                x.add_(pending)
        rows = ctx.logits_rows
        if rows is None or rows.numel() == 0:
            return None
        x = self.norm(x[rows])
        logits = getattr(self.lm_head, "logits", None)  # a quantized head's fp32 product (QuantLinear.logits)
        return logits(x) if logits is not None else self.lm_head(x).float()


def reference_context(model: LlamaModel, n: int, logits_rows: torch.Tensor | None, block_size: int = 16
                      ) -> StepContext:
    """The context of one n-token prefill through the reference attention and eager ops, on a scratch KV cache
    of its own (calibration and quality checks, outside any engine)."""
    cfg, dev = model.cfg, model.embed.weight.device
    pages = -(-n // block_size)
    kv = KVCache(cfg, pages, block_size, model.embed.weight.dtype, dev)
    attn = TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    lay = BatchLayout(block_size, torch.arange(n, device=dev), [], [], [list(range(pages))], [n], [n])
    return StepContext(torch.arange(n, device=dev), logits_rows, attn, attn.prepare(lay, dev), kv, EagerOps())


@torch.inference_mode()
def activation_maxima(model: nn.Module, ids: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """Per input channel max |x| of every decoder linear (keyed by layer index and name) over one prefill of
    `ids`, through the reference attention and eager ops on a scratch KV cache."""
    dev = model.embed.weight.device
    ctx = reference_context(model, len(ids), None)
    maxima: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        for name in LAYER_LINEARS:
            def record(_mod, args, key=(i, name)):
                maxima[key] = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0).float().cpu()
            hooks.append(getattr(layer, name).register_forward_pre_hook(record))
    try:
        model(torch.tensor(ids, device=dev), ctx)
    finally:
        for h in hooks:
            h.remove()
    return maxima
