"""Per-request sampling parameters: validation and the msgpack wire form.

This module is imported by the gateway (through the wire protocol), so it must
stay free of torch. The vectorized sampler that applies these parameters to a
batch of logits lives in `worker.sampler`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from worker.errors import bad_request


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 => greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 => off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of the chosen token

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError("bad_request", param=<field>) on the first invalid field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad_request("max_tokens must be a positive integer", "max_tokens")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad_request("temperature must be a finite number >= 0", "temperature")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad_request("top_p must be in (0, 1]", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad_request("top_k must be an integer >= 0 (0 disables it)", "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad_request("seed must be an integer or null", "seed")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build from the wire map; unknown keys and wrong types raise RequestError."""
        if not isinstance(d, dict):
            raise bad_request("sampling must be a map", "sampling")
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise bad_request(f"unknown sampling field {key!r}", str(key))
        kw = dict(d)
        _check_type(kw, "max_tokens", int)
        _check_type(kw, "temperature", (int, float))
        _check_type(kw, "top_p", (int, float))
        _check_type(kw, "top_k", int)
        _check_type(kw, "ignore_eos", bool)
        _check_type(kw, "logprobs", bool)
        if kw.get("seed") is not None:
            _check_type(kw, "seed", int)
        if "stop_token_ids" in kw:
            stops = kw["stop_token_ids"]
            if not isinstance(stops, list | tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in stops
            ):
                raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
            kw["stop_token_ids"] = tuple(stops)
        for key in ("temperature", "top_p"):
            if key in kw:
                kw[key] = float(kw[key])
        return cls(**kw)

    def to_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
        }


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _check_type(kw: dict, key: str, types: type | tuple[type, ...]) -> None:
    if key not in kw:
        return
    value = kw[key]
    wants_bool = types is bool
    if (isinstance(value, bool) and not wants_bool) or not isinstance(value, types):
        raise bad_request(f"{key} has the wrong type", key)
