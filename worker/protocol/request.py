"""What a `gen` request asks for and how a request can fail: priority, sampling and error codes.

Private to `worker.protocol`, which re-exports every name; import them from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum

from worker.protocol.grammar_spec import GrammarError, wire_key

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300


MAX_TOP_K = 2**31 - 1  # int64 tensors in the sampler; any k >= the vocabulary keeps every token
CACHE_RETENTIONS = ("", "in_memory", "24h")  # SamplingParams.cache_retention


class ErrorCode(StrEnum):
    """The `code` of an `err` frame."""

    CAPACITY = "capacity"
    BAD_REQUEST = "bad_request"
    INTERNAL = "internal"
    # the worker is draining: it hands the stream over (the gateway carries it on elsewhere)
    DRAINING = "draining"
    # the worker stopped waiting for the request's gateway (silent past its gateway timeout, e.g. a stalled
    # event loop): retryable, and a gateway that hears it carries the stream on (resume), as after a lost
    # worker
    ABANDONED = "abandoned"


class RequestError(Exception):
    """Ends one request: `code`, `message` and `retryable` go out in its `err` frame; `param` names the
    field."""

    def __init__(self, code: ErrorCode | str, message: str, *, param: str | None = None,
                 retryable: bool = False) -> None:
        try:
            self.code = ErrorCode(code)
        except ValueError:
            raise ValueError(f"unknown error code {code!r}") from None
        super().__init__(message)
        self.message = message
        self.param = param
        self.retryable = retryable

    def __repr__(self) -> str:
        return f"RequestError({self.code.value!r}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError(ErrorCode.BAD_REQUEST, message, param=param)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling; travels in `gen` as its `to_dict()` map. Applied by `worker.sample.sampler`."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 => greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 => off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of the chosen token
    top_logprobs: int = 0  # also the k most likely tokens and their logprobs (0..MAX_TOP_LOGPROBS)
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: divide (>0) or multiply (<0) logits of prompt+output tokens
    min_tokens: int = 0  # stop ids (EOS included) are banned until this many tokens are out
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    # constrained output: a `GrammarSpec.to_dict()` map (worker.protocol.grammar_spec)
    grammar: dict | None = None
    # False opts out of n-gram speculative decoding (same output; sent only when False)
    speculative: bool = True
    # OpenAI's prompt_cache_retention: "in_memory" (KV tiers in RAM only) | "24h" (may go to disk) | "" (the
    # worker's policy); sent only when set
    cache_retention: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError("bad_request", param=<field>) on the first invalid field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad_request("max_tokens must be a positive integer", "max_tokens")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad_request("temperature must be a finite number >= 0", "temperature")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad_request("top_p must be in (0, 1]", "top_p")
        if (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                or not 0 <= self.top_k <= MAX_TOP_K):
            raise bad_request(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables it)", "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise bad_request("seed must be a 64-bit integer or null", "seed")
        self._validate_extras(vocab_size)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")

    def _validate_extras(self, vocab_size: int) -> None:
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad_request(f"{name} must be in [-2, 2]", name)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise bad_request("repetition_penalty must be in (0, 2]", "repetition_penalty")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad_request("min_tokens must be in [0, max_tokens]", "min_tokens")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
        for entry in self.logit_bias:
            if (len(entry) != 2 or not _is_int(entry[0]) or not 0 <= entry[0] < vocab_size
                    or not _is_number(entry[1]) or not -100.0 <= entry[1] <= 100.0):
                raise bad_request(f"logit_bias must map token ids in [0, {vocab_size}) to values in "
                                  "[-100, 100]", "logit_bias")
        if self.cache_retention not in CACHE_RETENTIONS:
            raise bad_request("prompt_cache_retention must be 'in_memory' or '24h'", "prompt_cache_retention")
        # shape only: the schema itself is checked where it compiles, off the loop
        if self.grammar is not None:
            try:
                wire_key(self.grammar)
            except GrammarError as e:
                raise bad_request(e.message, e.param) from None

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
        for key, kinds in (("max_tokens", int), ("temperature", (int, float)), ("top_p", (int, float)),
                           ("top_k", int), ("ignore_eos", bool), ("logprobs", bool), ("top_logprobs", int),
                           ("presence_penalty", (int, float)), ("frequency_penalty", (int, float)),
                           ("repetition_penalty", (int, float)), ("min_tokens", int), ("speculative", bool)):
            _check_type(kw, key, kinds)
        if kw.get("seed") is not None:
            _check_type(kw, "seed", int)
        if "cache_retention" in kw:
            _check_type(kw, "cache_retention", str)
        if "stop_token_ids" in kw:
            stops = kw["stop_token_ids"]
            if not isinstance(stops, list | tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in stops
            ):
                raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
            kw["stop_token_ids"] = tuple(stops)
        if "logit_bias" in kw:
            kw["logit_bias"] = _bias_pairs(kw["logit_bias"])
        if kw.get("grammar") is not None and not isinstance(kw["grammar"], dict):
            raise bad_request("grammar must be a map", "response_format")
        for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if key in kw:
                kw[key] = float(kw[key])
        return cls(**kw)

    def to_dict(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop_token_ids": list(self.stop_token_ids),
                "ignore_eos": self.ignore_eos, "logprobs": self.logprobs, **self._extras()}

    def _extras(self) -> dict:
        """The optional controls, only where they differ from their defaults (a default request's map is
        small)."""
        out: dict = {}
        for name, off in (("top_logprobs", 0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0), ("min_tokens", 0)):
            if getattr(self, name) != off:
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = [list(e) for e in self.logit_bias]
        if self.grammar is not None:
            out["grammar"] = dict(self.grammar)
        if not self.speculative:
            out["speculative"] = False
        if self.cache_retention:
            out["cache_retention"] = self.cache_retention
        return out


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, list | tuple) or not all(
            isinstance(e, list | tuple) and len(e) == 2 and _is_int(e[0]) and _is_number(e[1])
            for e in value):
        raise bad_request("logit_bias must be a list of [token id, bias] pairs", "logit_bias")
    return tuple((int(i), float(b)) for i, b in value)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _check_type(kw: dict, key: str, types: type | tuple[type, ...]) -> None:
    if key not in kw:
        return
    value = kw[key]
    if (isinstance(value, bool) and types is not bool) or not isinstance(value, types):
        raise bad_request(f"{key} has the wrong type", key)
