"""Vectorized token sampling for a batch of logit rows (greedy, temperature, top-k, top-p).

Randomness is a hash of (seed, step, token id): a seeded request samples the same whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters, already as tensors on the logits' device."""

    temperature: torch.Tensor  # [n] float32, 0 => greedy
    top_k: torch.Tensor  # [n] int64, 0 => off
    top_p: torch.Tensor  # [n] float32
    seed: torch.Tensor  # [n] int64 (32-bit values)
    step: torch.Tensor  # [n] int64: index of the token being drawn within the request
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    want_logprobs: bool


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3 finalizer on 32-bit values held in int64 (products wrap; we keep the low 32 bits)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] uniforms in (0, 1), a pure function of (seed, step, token id)."""
    base = _fmix32((seed * 0x9E3779B1 + step * 0x85EBCA77 + 0x165667B1) & _M32)
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    h = _fmix32((base[:, None] ^ ((ids * 0x27D4EB2F) & _M32)[None, :]) & _M32)
    h = _fmix32((h + base[:, None]) & _M32)
    return (h.to(torch.float64) + 0.5).div_(4294967296.0).to(torch.float32)


def restrict_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k set and top-p nucleus; returns a new tensor."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop_sorted = ranks[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1)
    # keep a token while the mass before it is < top_p (the top token always stays)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted |= mass_before >= top_p[:, None]
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw one token per row. logits: [n, vocab] float32. Returns (tokens [n] int64, logprobs [n] or None)."""
    greedy_tokens = torch.argmax(logits, dim=-1)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        temp = batch.temperature.clamp(min=1e-5)[:, None]
        scaled = logits / temp
        if batch.any_top_k or batch.any_top_p:
            scaled = restrict_logits(scaled, batch.top_k, batch.top_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = uniform_noise(batch.seed, batch.step, logits.shape[-1])
        # exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i
        drawn = torch.argmax(probs / (-torch.log(noise)), dim=-1)
        tokens = torch.where(batch.temperature > 0, drawn, greedy_tokens)
    logprobs = None
    if batch.want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs
