"""What a `gen` request asks for and how a request can fail: priority, sampling and error codes.

Private to `worker.protocol`, which re-exports every name; import them from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import IntEnum, StrEnum


class ErrorCode(StrEnum):
    """The `code` of an `err` frame."""

    CAPACITY = "capacity"
    BAD_REQUEST = "bad_request"
    INTERNAL = "internal"


class Priority(IntEnum):
    """Scheduling class: an int on the wire, its lower-case name to operators, tenants and metrics."""

    INTERACTIVE = 0
    BATCH = 1

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> Priority:
        """'interactive' or 'batch' (exactly) -> Priority; ValueError otherwise."""
        for member in cls:
            if name == member.label:
                return member
        raise ValueError(f"priority must be one of {', '.join(PRIORITY_NAMES)}, got {name!r}")


PRIORITY_NAMES = tuple(p.label for p in Priority)


class RequestError(Exception):
    """Ends one request: `code`, `message` and `retryable` go out in its `err` frame; `param` names the field."""

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
    """Per-request sampling; travels in `gen` as its `to_dict()` map. Applied by `worker.sampler`."""

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
        for key, kinds in (("max_tokens", int), ("temperature", (int, float)), ("top_p", (int, float)),
                           ("top_k", int), ("ignore_eos", bool), ("logprobs", bool)):
            _check_type(kw, key, kinds)
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
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop_token_ids": list(self.stop_token_ids),
                "ignore_eos": self.ignore_eos, "logprobs": self.logprobs}


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _check_type(kw: dict, key: str, types: type | tuple[type, ...]) -> None:
    if key not in kw:
        return
    value = kw[key]
    if (isinstance(value, bool) and types is not bool) or not isinstance(value, types):
        raise bad_request(f"{key} has the wrong type", key)
