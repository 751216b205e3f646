"""The OpenAPI 3.1 description of the gateway's HTTP API, served at `GET /openapi.json`.

Hand-written like the request parser (`gateway.openai.schemas`), whose bounds it states; `tests/faults`
checks the two against each other.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.openai.schemas import (
    CHAT_ROLES,
    MAX_CACHE_KEY,
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    PRIORITIES,
)
from gateway.openai.tools import MAX_TOOLS

INT32_MAX = 2**31 - 1
JSON = "application/json"

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

_ERROR_STATUSES = {
    "400": "Invalid request: malformed JSON, a field of the wrong type or range (`param` names it), "
           "token ids outside the vocabulary, or `context_length_exceeded`.",
    "401": "Missing, unknown or revoked API key, or a disabled tenant (`invalid_api_key`).",
    "403": "The key or its tenant may not use this model (`model_not_allowed`).",
    "404": "Unknown model (`model_not_found`).",
    "408": "The request body did not arrive within the body timeout (`request_timeout`).",
    "413": "The request body is over the size limit (`request_too_large`).",
    "415": "A content type other than application/json (`unsupported_media_type`).",
    "429": "The tenant's quota (requests/min, tokens/min, concurrency); see `retry-after`.",
    "503": "Our capacity, not your quota: `no_live_worker`, `server_overloaded`, "
           "`quota_service_unavailable`, `worker_unavailable` or `server_shutting_down`; retry after "
           "`retry-after` seconds.",
}

_USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {"type": "object",
                                  "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}},
    },
}

# OpenAPI 3.1 reads a text/event-stream schema as the schema of each event: a chunk, the
# usage chunk, a final {"error": ...} or "[DONE]", each as one `data:` line.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "minLength": 1}}}

_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None]}
_TOOL_CALL = {"type": "object", "required": ["id", "function"],
              "properties": {"id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
                             "function": {"type": "object", "required": ["name", "arguments"],
                                          "properties": {"name": {"type": "string"},
                                                         "arguments": {"type": "string"}}}}}


def _integer(lo: int, hi: int, description: str = "") -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi,
            **({"description": description} if description else {})}


def _nullable(props: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
    """The parser reads a JSON null as "not given": every optional field also takes null."""
    out = {}
    for name, spec in props.items():
        if name in required:
            out[name] = spec
        elif "anyOf" in spec:
            out[name] = {**spec, "anyOf": [*spec["anyOf"], {"type": "null"}]}
        else:
            out[name] = {**spec, "type": [spec["type"], "null"]}
            if "enum" in spec:
                out[name]["enum"] = [*spec["enum"], None]
    return out


def _common_fields() -> dict[str, Any]:
    return {
        "model": {"type": "string", "minLength": 1, "examples": ["default"]},
        "max_tokens": _integer(1, INT32_MAX, "Completion tokens; also capped by the tenant and the context."),
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": _integer(-1, 1_000_000, "0 or -1: no top-k."),
        "seed": _integer(-(2**63), 2**64 - 1),
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": MAX_STOP,
                            "items": {"type": "string", "minLength": 1}}]},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": ["boolean", "null"]}}},
        "n": _integer(1, MAX_N, "Choices per prompt: sibling sequences that share the prompt's KV pages; "
                      "the prompt is prefilled and billed once, every choice's tokens count."),
        "user": {"type": "string", "description": "Accepted and ignored."},
        "metadata": {"type": "object", "description": "Accepted and ignored."},
        "store": {"type": "boolean", "description": "Accepted and ignored: nothing is stored."},
        "service_tier": {"type": "string", "description": "Accepted and ignored; see `priority`."},
        "safety_identifier": {"type": "string", "description": "Accepted and ignored."},
        "prompt_cache_key": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_KEY,
                             "description": "Routes requests with the same key (within your tenant) "
                                            "together."},
        "prompt_cache_retention": {"type": "string", "enum": ["in_memory", "24h"],
                                   "description": "in_memory: evicted prefix pages stay in the workers' RAM "
                                                  "tier; 24h: they may also be written to a disk tier."},
        "ignore_eos": {"type": "boolean"},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2,
                               "description": "HF/vLLM: over prompt and output tokens; 1 is off."},
        "min_tokens": _integer(0, INT32_MAX, "Stop tokens are banned until this many are out."),
        "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                       "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                       "description": "Token id (a string) to a bias added to its logit; ids must be in the "
                                      "vocabulary."},
        "priority": {"type": "string", "enum": list(PRIORITIES)},
        "response_format": _response_format(),
        "speculative": {"type": "boolean", "description": "Extension: false opts out of n-gram speculative "
                                                          "decoding (the output is the same either way)."},
    }


def _response_format() -> dict[str, Any]:
    def plain(kind: str) -> dict[str, Any]:
        return {"type": "object", "required": ["type"], "additionalProperties": False,
                "properties": {"type": {"type": "string", "enum": [kind]}}}
    json_schema = {"type": "object", "additionalProperties": False, "properties": {
        "name": {"type": ["string", "null"]}, "description": {"type": ["string", "null"]},
        "strict": {"type": ["boolean", "null"], "description": "Output always follows the schema."},
        "schema": {"type": ["object", "null"],
                   "description": "A JSON schema; keywords that cannot be enforced "
                   "(not, if/then/else, uniqueItems, contains, ...) are a 400 naming "
                   "`response_format.json_schema.schema`. null: any JSON object."}}}
    return {"anyOf": [plain("text"), plain("json_object"),
                      {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
                       "properties": {"type": {"type": "string", "enum": ["json_schema"]},
                                      "json_schema": json_schema}}],
            "description": "Constrains the output: text (none), any JSON object, or a JSON schema. An output "
                           "cut by max_tokens ends with finish_reason `length` and may be incomplete JSON."}


def _tool_fields() -> dict[str, Any]:
    function = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"], "description": "A JSON schema (the call's arguments "
                       "follow it); keywords that cannot be enforced are a 400 naming "
                       "tools[i].function.parameters."},
        "strict": {"type": ["boolean", "null"], "description": "Calls always follow the schema."}}}
    tool = {"type": "object", "required": ["type", "function"], "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ["function"]}, "function": function}}
    named = {"type": "object", "required": ["type", "function"],
             "properties": {"type": {"type": "string", "enum": ["function"]},
                            "function": {"type": "object", "required": ["name"],
                                         "properties": {"name": {"type": "string"}}}}}
    return {
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": tool,
                  "description": "Rendered as a Hermes-style system block; calls come back in "
                                 "`message.tool_calls` with finish_reason `tool_calls`."},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, named],
                        "description": "required / a named function: the call is grammar-constrained to the "
                                       "parameters' schema; auto: text or calls; none: tools are not shown. "
                                       "Needs `tools` unless none; an unknown name is a 400."},
        "parallel_tool_calls": {"type": "boolean", "description": "false: at most one call per choice."},
    }


def _chat_request() -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)},
                              "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part},
                                                    {"type": "null"}],
                                          "description": "null only in assistant messages"},
                              "tool_calls": {"type": ["array", "null"], "minItems": 1, "items": _TOOL_CALL,
                                             "description": "assistant messages: the calls it made"},
                              "tool_call_id": {"type": ["string", "null"],
                                               "description": "required in `tool` messages"}}}
    props = {**_common_fields(), **_tool_fields(),
             "messages": {"type": "array", "minItems": 1, "items": message},
             "max_completion_tokens": _integer(1, INT32_MAX),
             "logprobs": {"type": "boolean"},
             "top_logprobs": _integer(0, MAX_TOP_LOGPROBS, "Alternatives per token; implies `logprobs`.")}
    required = ("model", "messages")
    return {"type": "object", "required": list(required), "properties": _nullable(props, required),
            "additionalProperties": False}


def _completion_request() -> dict[str, Any]:
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
           "description": "Token ids; each must be inside the model's vocabulary (400 otherwise)."}
    prompt = {"anyOf": [{"type": "string", "minLength": 1}, ids,
                        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                         "items": {"anyOf": [{"type": "string", "minLength": 1}, ids]}}],
              "description": "One prompt, or a batch: each prompt's `n` choices have index prompt_i * n + j."}
    props = {**_common_fields(), "prompt": prompt,
             "logprobs": _integer(0, MAX_COMPLETION_LOGPROBS, "Alternatives per token (0: the chosen only)."),
             "echo": {"type": "boolean", "description": "The prompt's text leads each choice's text; with "
                      "`logprobs` a 400 (prompt logprobs are not computed)."},
             "best_of": {"type": "integer", "enum": [1], "description": "Only 1: candidates are not ranked."}}
    required = ("model", "prompt")
    return {"type": "object", "required": list(required), "properties": _nullable(props, required),
            "additionalProperties": False}


def _choice(chat: bool) -> dict[str, Any]:
    if chat:
        body = {"message": {"type": "object", "required": ["role", "content"],
                            "properties": {"role": {"type": "string"},
                                           "content": {"type": ["string", "null"]},
                                           "tool_calls": {"type": "array", "items": _TOOL_CALL}}}}
    else:
        body = {"text": {"type": "string"}}
    return {"type": "object", "required": ["index", "finish_reason"],
            "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH,
                           "logprobs": {"type": ["object", "null"]}, **body}}


def _completion_response(obj: str, chat: bool) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": [obj]},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": _choice(chat)},
                           "usage": {"$ref": "#/components/schemas/Usage"}}}


def _error_responses(statuses: tuple[str, ...]) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/Error"}
    return {s: {"description": _ERROR_STATUSES[s], "content": {JSON: {"schema": ref}}} for s in statuses}


def _generate_op(summary: str, request: str, response: str) -> dict[str, Any]:
    ok = {"description": "The completion (JSON), or server-sent events when `stream` is true; a failure "
                         "after the first event arrives as a final `data: {\"error\": ...}` event.",
          "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{response}"}},
                      "text/event-stream": {"schema": _SSE_EVENT}}}
    errors = _error_responses(("400", "401", "403", "404", "408", "413", "415", "429", "503"))
    return {"post": {"summary": summary, "security": [{"bearer": []}],
                     "requestBody": {"required": True, "content": {
                         JSON: {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
                     "responses": {"200": ok, **errors}}}


def _plain_get(summary: str, media: str, schema: dict[str, Any], extra: dict[str, Any] | None = None,
               secured: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {media: {"schema": schema}}}, **(extra or {})}}
    if secured:
        op["security"] = [{"bearer": []}]
    return {"get": op}


def _model_get(card: dict[str, Any]) -> dict[str, Any]:
    op = _plain_get("One model this key may use", JSON, card, _error_responses(("401", "404", "503")),
                    secured=True)
    op["get"]["parameters"] = [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}]
    return op


def build_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document as a dict."""
    models = {"type": "object", "required": ["object", "data"],
              "properties": {"object": {"type": "string", "enum": ["list"]},
                             "data": {"type": "array", "items": {
                                 "type": "object", "required": ["id", "object"],
                                 "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                                "created": {"type": "integer"},
                                                "owned_by": {"type": "string"}}}}}}
    not_ready = {"503": {"description": "A worker or Redis is missing, or the gateway is draining.",
                         "content": {JSON: {"schema": {"type": "object"}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Switchyard gateway", "version": "1.0.0",
                 "description": "OpenAI-compatible chat and text completions for many tenants."},
        "paths": {
            "/v1/chat/completions": _generate_op("Chat completion", "ChatCompletionRequest",
                                                 "ChatCompletion"),
            "/v1/completions": _generate_op("Text completion", "CompletionRequest", "Completion"),
            "/v1/models": _plain_get("Models this key may use", JSON, models,
                                     _error_responses(("401", "503")), secured=True),
            "/v1/models/{model}": _model_get(models["properties"]["data"]["items"]),
            "/health": _plain_get("Liveness", JSON, {"type": "object"}),
            "/ready": _plain_get("Readiness (worker and Redis reachable, not draining)", JSON,
                                 {"type": "object"}, not_ready),
            "/metrics": _plain_get("Prometheus metrics", "text/plain", {"type": "string"}),
            "/openapi.json": _plain_get("This document", JSON, {"type": "object"}),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "ChatCompletionRequest": _chat_request(),
                "CompletionRequest": _completion_request(),
                "ChatCompletion": _completion_response("chat.completion", chat=True),
                "Completion": _completion_response("text_completion", chat=False),
                "Usage": _USAGE,
                "Error": _ERROR,
            },
        },
    }


_BODY = json.dumps(build_document()).encode()


async def openapi_endpoint(request: Request) -> Response:
    return Response(_BODY, media_type=JSON)
