"""Strict parsing of OpenAI request bodies into typed records; a bad known field is a 400 naming it.

Knows nothing about tenants or tokenizers: their limits are applied later by the service.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.errors import invalid
from worker.protocol import PRIORITY_NAMES, Priority

MAX_STOP = 4
PRIORITIES = PRIORITY_NAMES
CHAT_ROLES = ("system", "user", "assistant", "developer")
_MISSING = object()


@dataclass(slots=True)
class GenerationRequest:
    """One validated chat or completion request (before tokenization)."""

    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    priority: Priority | None = None


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    """The field's value, None when absent or null; 400 when of the wrong JSON type."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return None
    # JSON true/false are Python bools, which are ints too: never accept them as numbers.
    if isinstance(value, bool) and bool not in kinds:
        raise invalid(f"'{name}' must be {what}, got a boolean.", param=name)
    if not isinstance(value, kinds):
        raise invalid(f"'{name}' must be {what}.", param=name)
    return value


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = _get(body, name, (int, float), "a number")
    if value is None:
        return default
    if not math.isfinite(value) or not lo <= value <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {value}.", param=name)
    return float(value)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = _get(body, name, (int,), "an integer")
    if value is not None and not lo <= value <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {value}.", param=name)
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = _get(body, name, (bool,), "a boolean")
    return default if value is None else value


def _stop(body: dict) -> tuple[str, ...]:
    value = _get(body, "stop", (str, list), "a string or an array of strings")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' may hold at most {MAX_STOP} sequences, got {len(stops)}.", param="stop")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise invalid("'stop' entries must be non-empty strings.", param="stop")
    return tuple(stops)


def _common(body: Any, kind: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    model = _get(body, "model", (str,), "a string")
    if not model:
        raise invalid("'model' is required.", param="model")
    n = _get(body, "n", (int,), "an integer")
    if n is not None and n != 1:
        raise invalid(f"Only n=1 is supported, got n={n}.", param="n")
    stream = _bool(body, "stream")
    options = _get(body, "stream_options", (dict,), "an object")
    include_usage = False
    if options is not None:
        include_usage = _bool(options, "include_usage")
    priority = _get(body, "priority", (str,), "a string")
    if priority is not None and priority not in PRIORITIES:
        raise invalid(f"'priority' must be one of {', '.join(PRIORITIES)}.", param="priority")
    top_k = _int(body, "top_k", -1, 1_000_000)
    return GenerationRequest(
        kind=kind,
        model=model,
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_top_p(body),
        top_k=0 if top_k is None or top_k < 0 else top_k,
        seed=_int(body, "seed", -(2**63), 2**64 - 1),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage and stream,
        user=_get(body, "user", (str,), "a string"),
        ignore_eos=_bool(body, "ignore_eos"),
        priority=None if priority is None else Priority.parse(priority),
    )


def _top_p(body: dict) -> float:
    value = _number(body, "top_p", 0.0, 1.0, 1.0)
    if value <= 0.0:
        raise invalid("'top_p' must be greater than 0 and at most 1.", param="top_p")
    return value


def _max_tokens(body: dict, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = _int(body, name, 1, 2**31 - 1)
        if value is not None:
            return value
    return None


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("Message content must be a string or an array of text parts.", param=param)
    texts: list[str] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid("Only text content parts ({'type': 'text', 'text': ...}) are supported.",
                          param=f"{param}[{i}]")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict) -> list[dict[str, str]]:
    raw = _get(body, "messages", (list,), "an array of messages")
    if not raw:
        raise invalid("'messages' must be a non-empty array.", param="messages")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid("Each message must be an object.", param=param)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"'role' must be one of {', '.join(CHAT_ROLES[:3])}.", param=f"{param}.role")
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        text = _content(content, f"{param}.content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


def parse_chat(body: Any) -> GenerationRequest:
    req = _common(body, "chat")
    req.messages = _messages(body)
    req.max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    req.logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and top > 1:
        raise invalid("Only the chosen token's logprob is available: 'top_logprobs' must be 0 or 1.",
                      param="top_logprobs")
    return req


def _prompt(body: dict) -> str | list[int]:
    value = _get(body, "prompt", (str, list), "a string or an array of token ids")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if value is None or (isinstance(value, str | list) and len(value) == 0):
        raise invalid("'prompt' must be a non-empty string or array of token ids.", param="prompt")
    if isinstance(value, list):
        for tok in value:
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise invalid("'prompt' must be a string or one array of integer token ids "
                              "(batches of several prompts are not supported).", param="prompt")
    return value


def parse_completion(body: Any) -> GenerationRequest:
    req = _common(body, "completion")
    req.prompt = _prompt(body)
    req.max_tokens = _max_tokens(body, ("max_tokens",))
    logprobs = _int(body, "logprobs", 0, 5)
    if logprobs is not None and logprobs > 1:
        raise invalid("Only the chosen token's logprob is available: 'logprobs' must be 0 or 1.",
                      param="logprobs")
    req.logprobs = logprobs is not None
    if _bool(body, "echo"):
        raise invalid("'echo' is not supported.", param="echo")
    return req
