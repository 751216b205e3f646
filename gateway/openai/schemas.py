"""Strict parsing of OpenAI request bodies into typed records; a bad or unknown field is a 400 naming it.

Knows nothing about tenants or tokenizers: their limits are applied later by the service.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.priorities import PRIORITY_NAMES, Priority
from gateway.openai.tools import ToolRequest, message_tool_calls, parse_tools
from gateway.web.api_errors import invalid
from worker.protocol import GrammarError, GrammarSpec, json_object_spec, json_schema_spec
from worker.protocol.grammar_spec import MAX_SCHEMA_BYTES

MAX_STOP = 4
PRIORITIES = PRIORITY_NAMES
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_N = 8  # choices per prompt (`n`, `best_of`)
MAX_PROMPTS = 16  # prompts in one completions request
MAX_CACHE_KEY = 256
MAX_LOGIT_BIAS = 300
MAX_MESSAGES = 2048
# numbers a body may hold beside prompts, logit_bias and schemas (max_tokens, seed, ...)
BODY_NUMBER_SLACK = 64
MAX_TOP_LOGPROBS = 20  # chat `top_logprobs`
MAX_COMPLETION_LOGPROBS = 5  # completions `logprobs`
_MISSING = object()

# Accepted and deliberately ignored (listed in README): they change nothing we compute.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier"})
_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                            "stream_options", "n", "ignore_eos", "priority", "prompt_cache_key",
                            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                            "logit_bias", "response_format", "speculative",
                            "prompt_cache_retention"}) | IGNORED_FIELDS
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
# Known OpenAI fields not implemented (yet): a clearer message than "unknown".
_UNSUPPORTED = frozenset({"functions", "function_call", "audio",
                          "modalities", "prediction", "reasoning_effort", "web_search_options", "suffix"})


@dataclass(slots=True)
class GenerationRequest:
    """One validated chat or completion request (before tokenization)."""

    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict[str, Any]] | None = None  # role, content; assistant tool_calls; tool tool_call_id
    prompt: str | list[int] | None = None  # the first (often only) prompt of `prompts`
    prompts: list[str | list[int]] | None = None  # completions: every prompt, each served as its own choices
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt text leads each choice's text
    tools: ToolRequest | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    prompt_cache_key: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # token ids checked against the vocabulary by the model
    ignore_eos: bool = False
    priority: Priority | None = None
    batch_line: bool = False  # a Batch API line (never from a body): priced at the model's batch fraction
    grammar: GrammarSpec | None = None  # from `response_format`: the output is constrained to it
    speculative: bool = True  # extension: false opts out of n-gram speculative decoding (same output)
    # "in_memory" (KV tiers in RAM only) | "24h" (may go to disk) | "": default
    prompt_cache_retention: str = ""
    # "responses": a chat request that came as a Responses one (`gateway.openai.responses_shape`)
    api: str = ""
    instructions: str | None = None  # responses: the system message, never carried to the next turn
    # responses: the turns so far (a previous response's, then input)
    conversation: list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    new_turns: int = 0  # responses: how many turns of `conversation` this request's input added
    store: bool = True  # responses: keep it (`gateway.responses.response_store`)
    # responses: run as a gateway task, polled by id (`gateway.responses.background`)
    background: bool = False


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str, param: str | None = None) -> Any:
    """The field's value, None when absent or null; 400 (naming `param`, default `name`) if mistyped."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return None
    param = param or name
    # JSON true/false are Python bools, which are ints too: never accept them as numbers.
    if isinstance(value, bool) and bool not in kinds:
        raise invalid(f"'{param}' must be {what}, got a boolean.", param=param)
    if not isinstance(value, kinds):
        raise invalid(f"'{param}' must be {what}.", param=param)
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


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in _UNSUPPORTED:
            if value is None:
                continue
            raise invalid(f"'{name}' is not supported by this server.", param=name)
        raise invalid(f"Unrecognized request argument supplied: {name}", param=str(name))


def _common(body: Any, kind: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    _check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    model = _get(body, "model", (str,), "a string")
    if not model:
        raise invalid("'model' is required.", param="model")
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
        n=_int(body, "n", 1, MAX_N) or 1,
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_top_p(body),
        top_k=0 if top_k is None or top_k < 0 else top_k,
        seed=_int(body, "seed", -(2**63), 2**64 - 1),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage and stream,
        user=_get(body, "user", (str,), "a string"),
        prompt_cache_key=_cache_key(body),
        ignore_eos=_bool(body, "ignore_eos"),
        priority=None if priority is None else Priority.parse(priority),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=_repetition(body),
        min_tokens=_int(body, "min_tokens", 0, 2**31 - 1) or 0,
        logit_bias=_logit_bias(body),
        grammar=_response_format(body.get("response_format")),
        speculative=_bool(body, "speculative", True),
        prompt_cache_retention=_retention(body),
    )


def _retention(body: dict) -> str:
    value = _get(body, "prompt_cache_retention", (str,), "a string")
    if value is not None and value not in ("in_memory", "24h"):
        raise invalid("'prompt_cache_retention' must be 'in_memory' or '24h'.",
                      param="prompt_cache_retention")
    return value or ""


_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def _response_format(value: Any) -> GrammarSpec | None:
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict, description}}"""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("'response_format' must be an object.", param="response_format")
    kind = value.get("type")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    for key in value:
        if key not in allowed:
            raise invalid(f"Unrecognized argument in response_format: {key}", param=f"response_format.{key}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec()
    if kind != "json_schema":
        raise invalid("'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
                      param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("'response_format.json_schema' must be an object.", param="response_format.json_schema")
    for key in spec:
        if key not in _JSON_SCHEMA_KEYS:
            raise invalid(f"Unrecognized argument in response_format.json_schema: {key}",
                          param=f"response_format.json_schema.{key}")
    for key, kinds, what in (("name", (str,), "a string"), ("description", (str,), "a string"),
                             ("strict", (bool,), "a boolean")):
        _get(spec, key, kinds, what, f"response_format.json_schema.{key}")
    if spec.get("schema") is None:
        return json_object_spec()
    try:
        return json_schema_spec(spec["schema"])
    except GrammarError as e:
        raise invalid(e.message, param=e.param) from None


def _repetition(body: dict) -> float:
    value = _number(body, "repetition_penalty", 0.0, 2.0, 1.0)
    if value <= 0.0:
        raise invalid("'repetition_penalty' must be greater than 0 and at most 2.",
                      param="repetition_penalty")
    return value


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    value = _get(body, "logit_bias", (dict,), "an object mapping token ids to numbers")
    if not value:
        return ()
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries.", param="logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in value.items():
        if not isinstance(key, str) or not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise invalid(f"'logit_bias' keys must be token ids, got {str(key)[:20]!r}.", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise invalid("'logit_bias' values must be numbers between -100 and 100.", param="logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def _cache_key(body: dict) -> str | None:
    value = _get(body, "prompt_cache_key", (str,), "a string")
    if value is not None and not 0 < len(value) <= MAX_CACHE_KEY:
        raise invalid(f"'prompt_cache_key' must be 1 to {MAX_CACHE_KEY} characters.",
                      param="prompt_cache_key")
    return value


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


def _messages(body: dict) -> list[dict[str, Any]]:
    raw = _get(body, "messages", (list,), "an array of messages")
    if not raw:
        raise invalid("'messages' must be a non-empty array.", param="messages")
    if len(raw) > MAX_MESSAGES:  # each renders to a few tokens at least: more can never fit a context
        raise invalid(f"'messages' may hold at most {MAX_MESSAGES} messages.", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid("Each message must be an object.", param=param)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"'role' must be one of {', '.join(CHAT_ROLES[:3])}.", param=f"{param}.role")
        content = msg.get("content")
        item: dict[str, Any] = {"role": "system" if role == "developer" else role}
        if msg.get("tool_calls") is not None:
            if role != "assistant":
                raise invalid("Only assistant messages carry 'tool_calls'.", param=f"{param}.tool_calls")
            item["tool_calls"] = message_tool_calls(msg, param)
        if content is None and role == "assistant":
            content = ""
        call_id = msg.get("tool_call_id")
        if role == "tool" or call_id is not None:
            if role != "tool" or not isinstance(call_id, str) or not call_id:
                raise invalid("A 'tool' message, and only one, needs a 'tool_call_id' string.",
                              param=f"{param}.tool_call_id")
            item["tool_call_id"] = call_id
        item["content"] = _content(content, f"{param}.content")
        out.append(item)
    return out


def parse_chat(body: Any) -> GenerationRequest:
    req = _common(body, "chat")
    req.messages = _messages(body)
    req.max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    req.logprobs = _bool(body, "logprobs")
    req.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    req.logprobs = req.logprobs or req.top_logprobs > 0  # alternatives come with the chosen token's logprob
    req.tools = parse_tools(body)
    if req.tools is not None and req.tools.active:
        if req.grammar is not None:
            raise invalid("'response_format' cannot be combined with 'tools' unless tool_choice is 'none'.",
                          param="response_format")
        req.grammar = req.tools.grammar()
    _check_min_tokens(req)
    return req


def _check_min_tokens(req: GenerationRequest) -> None:
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise invalid(f"'min_tokens' ({req.min_tokens}) is above max_tokens ({req.max_tokens}).",
                      param="min_tokens")


def _prompts(body: dict) -> list[str | list[int]]:
    """A string, an array of token ids, or an array of several of either (a batch of prompts)."""
    value = _get(body, "prompt", (str, list), "a string or an array of token ids")
    batch = value if isinstance(value, list) and value and isinstance(value[0], str | list) else [value]
    if len(batch) > MAX_PROMPTS:
        raise invalid(f"'prompt' may hold at most {MAX_PROMPTS} prompts.", param="prompt")
    for i, prompt in enumerate(batch):
        param = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if prompt is None or not isinstance(prompt, str | list) or len(prompt) == 0:
            raise invalid("Each prompt must be a non-empty string or array of token ids.", param=param)
        if isinstance(prompt, list) and any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise invalid("A prompt must be a string or an array of integer token ids.", param=param)
    return batch


def parse_completion(body: Any) -> GenerationRequest:
    req = _common(body, "completion")
    req.prompts = _prompts(body)
    req.prompt = req.prompts[0]
    req.max_tokens = _max_tokens(body, ("max_tokens",))
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    req.logprobs = logprobs is not None
    req.top_logprobs = logprobs or 0
    _check_min_tokens(req)
    req.echo = _bool(body, "echo")
    if req.echo and req.logprobs:
        raise invalid("'echo' with 'logprobs' is not supported (prompt logprobs are not computed).",
                      param="echo")
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of not in (None, 1):
        raise invalid("'best_of' above 1 is not supported (candidates are not ranked); use 'n'.",
                      param="best_of")
    return req


def body_number_cap(max_context: int) -> int:
    """The most numbers a valid body can hold: MAX_PROMPTS token-id prompts of up to the context each, the
    logit_bias values, and as many as the largest tool and response schemas can spell; a body past it is
    refused while it is decoded (each prompt's own length is checked once parsed)."""
    return max_context * MAX_PROMPTS + MAX_LOGIT_BIAS + MAX_SCHEMA_BYTES // 2 + BODY_NUMBER_SLACK
