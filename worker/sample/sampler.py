"""Vectorized token sampling for a batch of logit rows (greedy, temperature, top-k, top-p, logprobs).

Randomness is a hash of (seed, step, token id): a seeded request samples the same whatever shares its batch.
On CPU the draw runs in one fused C++ pass (`csrc/race_sample.cpp`); the torch path is its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels.cpu import race_sample_kernel
from worker.sample.grammar import apply_bitmask
from worker.sample.logit_adjust import LogitAdjust

_M32 = 0xFFFFFFFF
# top-k / top-p look at this many likeliest tokens before the whole vocabulary
NUCLEUS_CANDIDATES = (256, 4096)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters, already as tensors on the logits' device."""

    temperature: torch.Tensor  # [n] float32, 0 => greedy
    top_k: torch.Tensor  # [n] int64, 0 => off
    top_p: torch.Tensor  # [n] float32
    seed: torch.Tensor  # [n] int64: the seed's low 32 bits
    step: torch.Tensor  # [n] int64: index of the token being drawn within the request
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    want_logprobs: bool
    top_logprobs: int = 0  # the most any row asks for
    adjust: LogitAdjust | None = None  # penalties, bias, bans; None when no row uses them
    seed_hi: torch.Tensor | None = None  # [n] int64: the seed's high 32 bits (None: all zero)
    grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None  # (bitmask [m, words], rows [m]) or None


@dataclass(slots=True)
class Sampled:
    tokens: torch.Tensor  # [n] int64
    logprobs: torch.Tensor | None  # [n]: the chosen tokens' logprobs under the model's distribution
    top_ids: torch.Tensor | None = None  # [n, k]
    top_logprobs: torch.Tensor | None = None  # [n, k]


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3 finalizer on 32-bit values held in int64 (products wrap; we keep the low 32 bits)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """`_fmix32` in place: one temporary per shift instead of one per operation."""
    h ^= h >> 16
    h.mul_(0x85EBCA6B).bitwise_and_(_M32)
    h ^= h >> 13
    h.mul_(0xC2B2AE35).bitwise_and_(_M32)
    h ^= h >> 16
    return h


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int,
                  seed_hi: torch.Tensor | None = None) -> torch.Tensor:
    """[n, vocab] uniforms in (0, 1) (24-bit resolution), a pure function of (seed, step, token id)."""
    mixed = seed * 0x9E3779B1 + step * 0x85EBCA77 + 0x165667B1
    if seed_hi is not None:
        mixed = mixed + _fmix32(seed_hi) * 0x27D4EB2F  # fmix32(0) == 0: 32-bit seeds are unchanged
    base = _fmix32(mixed & _M32)
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64).mul_(0x27D4EB2F).bitwise_and_(_M32)
    h = _fmix32_(base[:, None] ^ ids[None, :])
    h += base[:, None]
    h = _fmix32_(h.bitwise_and_(_M32))
    # (2^24 - 1) + 0.5 rounds to 2^24 in float32: clamp so that no u is 1 (its Exp(1) race value would be 0)
    return (h >> 8).to(torch.float32).add_(0.5).mul_(2.0**-24).clamp_(max=1.0 - 2.0**-24)


def restrict_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k set and top-p nucleus; returns a new tensor.

    A row is first restricted among its NUCLEUS_CANDIDATES likeliest tokens, and only where its kept set could
    reach past them is it redone with more: a full sort of the vocabulary is rare. Each row's result depends
    on that row alone. The nucleus edge is decided in float64 (see `nucleus_masses`), so the kept set does not
    depend on the CPU's float32 summation order."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = torch.ones_like(logits, dtype=torch.bool)
    free = (k >= vocab) & (top_p >= 1)
    drop[free] = False
    rows = torch.nonzero(~free)[:, 0]
    for c in [c for c in NUCLEUS_CANDIDATES if c < vocab] + [vocab]:
        if rows.numel() == 0:
            break
        sub, kr = logits[rows], k[rows]
        vals, order = torch.topk(sub, c, dim=-1)  # descending; at c == vocab, a sort
        drop_sorted = torch.arange(c, device=logits.device)[None, :] >= kr[:, None]
        whole = None if c == vocab else torch.where((kr >= vocab)[:, None], sub, float("-inf"))
        before = nucleus_masses(vals.masked_fill(drop_sorted, float("-inf")), whole)
        # keep a token while the mass before it is < top_p (the top token always stays; top_p 1 keeps all)
        pr = top_p[rows][:, None].double()
        drop_sorted |= (before >= pr) & (pr < 1)
        covered = (kr <= c) | ((kr >= vocab)
                               & drop_sorted[:, -1]) if c < vocab else torch.ones_like(kr).bool()
        drop[rows[covered][:, None], order[covered]] = drop_sorted[covered]
        rows = rows[~covered]
    return logits.masked_fill(drop, float("-inf"))


def nucleus_masses(kept_sorted: torch.Tensor, whole: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [rows, c]: the probability mass before each of a row's descending logits (-inf = dropped),
    normalized over the row itself, or over the finite entries of `whole` (the full vocabulary row) where
    `whole` has any. In float64 the sums over <= 2^17 terms are off by < 2^17 * 2^-53 ~ 1.5e-11, so a kept
    set can differ between CPUs only for a token whose mass sits that close to top_p."""
    kept = kept_sorted.double()
    norm = torch.logsumexp(kept, dim=-1, keepdim=True)
    if whole is not None:
        full = torch.logsumexp(whole.double(), dim=-1, keepdim=True)
        norm = torch.where(torch.isfinite(full), full, norm)
    probs = torch.exp(kept - norm)
    return torch.cumsum(probs, dim=-1) - probs


def _draw(logits: torch.Tensor, batch: SamplingBatch, greedy_tokens: torch.Tensor) -> torch.Tensor:
    scaled = logits / batch.temperature.clamp(min=1e-5)[:, None]
    if batch.any_top_k or batch.any_top_p:
        scaled = restrict_logits(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    del scaled
    kernel = race_sample_kernel() if probs.device.type == "cpu" else None
    if kernel is None:
        drawn = race_draw(probs, batch)
    else:
        hi = batch.seed_hi if batch.seed_hi is not None else _NO_SEED_HI
        drawn = kernel(probs, batch.seed, batch.step, hi)
    return torch.where(batch.temperature > 0, drawn, greedy_tokens)


def race_draw(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The exponential race in torch (the reference for the CPU kernel): argmax p / E with E ~ Exp(1) draws
    token i with probability p_i. Consumes `probs`."""
    race = uniform_noise(batch.seed, batch.step, probs.shape[-1], batch.seed_hi).log_().neg_()
    return torch.argmax(probs.div_(race), dim=-1)


_NO_SEED_HI = torch.empty(0, dtype=torch.int64)
def sample(logits: torch.Tensor, batch: SamplingBatch) -> Sampled:
    """Draw one token per row. logits: [n, vocab] float32, the model's (logprobs are computed from them)."""
    adjusted = logits if batch.adjust is None else batch.adjust.apply(logits)
    if batch.grammar_mask is not None:
        if adjusted is logits:
            adjusted = logits.clone()  # logprobs stay those of the model's distribution
        apply_bitmask(adjusted, *batch.grammar_mask)
    greedy_tokens = torch.argmax(adjusted, dim=-1)
    tokens = greedy_tokens if batch.all_greedy else _draw(adjusted, batch, greedy_tokens)
    out = Sampled(tokens, None)
    if batch.want_logprobs or batch.top_logprobs:
        lsm = torch.log_softmax(logits, dim=-1)
        out.logprobs = lsm.gather(-1, tokens[:, None]).squeeze(-1)
        if batch.top_logprobs:
            out.top_logprobs, out.top_ids = torch.topk(lsm, batch.top_logprobs, dim=-1)
    return out
