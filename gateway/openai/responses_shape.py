"""`POST /v1/responses` over the chat path: a Responses body as a chat request, and its Response object."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.openai.bodies import TokenLogprob, Usage
from gateway.openai.responses_items import (
    OutputItems,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    responses_param,
)
from gateway.openai.schemas import GenerationRequest, parse_chat
from gateway.openai.tool_output import ToolCallStream
from gateway.web.api_errors import ApiError, invalid

FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                    "store", "metadata", "user", "text", "reasoning", "tools", "tool_choice",
                    "parallel_tool_calls", "prompt_cache_key", "safety_identifier", "service_tier",
                    "truncation", "previous_response_id", "background"})
NOT_YET = frozenset({"conversation", "include", "prompt", "stream_options", "top_logprobs", "max_tool_calls"})
_PASSED_ON = ("model", "temperature", "top_p", "stream", "metadata", "user", "prompt_cache_key",
              "safety_identifier", "service_tier", "parallel_tool_calls")
# chat fields that name a Responses one in errors
_PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "messages": "input"}


def parse_responses(body: Any) -> GenerationRequest:
    """The chat request a Responses body asks for (400 naming the field otherwise)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    for name in body:
        if name in NOT_YET:
            raise invalid(f"'{name}' is not supported by this server's Responses API yet.", param=name)
        if name not in FIELDS:
            raise invalid(f"Unrecognized request argument supplied: {name}", param=name)
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("Only 'truncation': 'disabled' is supported.", param="truncation")
    chat: dict[str, Any] = {k: body[k] for k in _PASSED_ON if k in body}
    instructions = (_text(body["instructions"], "instructions") if body.get("instructions") is not None
                    else None)
    conversation, origins = chat_messages(body.get("input"))
    chat["messages"] = with_instructions(instructions, conversation)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("tools") is not None:
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    try:
        req = parse_chat(chat)
    except ApiError as exc:  # name the Responses field, not the chat one it became
        _rename(exc, (["instructions"] if instructions is not None else [])
                + [f"input[{i}]" for i in origins])
        raise
    req.api, req.instructions = "responses", instructions
    req.conversation = req.messages[1:] if instructions is not None else req.messages
    req.new_turns = len(req.conversation)
    _stored_fields(body, req)
    return req


def _rename(exc: ApiError, origins: list[str]) -> None:
    for chat_name, name in _PARAMS.items():
        exc.message = exc.message.replace(f"'{chat_name}'", f"'{name}'")
    exc.param = _PARAMS.get(exc.param or "", exc.param)
    if exc.param is not None:
        exc.param = responses_param(exc.param, origins)


def _stored_fields(body: dict, req: GenerationRequest) -> None:
    """`previous_response_id`, `store` and `background` (which needs `store` and no `stream`)."""
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous.startswith("resp_")):
        raise invalid("'previous_response_id' must be a response id (resp_...).",
                      param="previous_response_id")
    req.previous_response_id = previous
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise invalid("'store' must be a boolean.", param="store")
    req.store = store
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise invalid("'background' must be a boolean.", param="background")
    req.background = bool(background)
    if req.background and not store:
        raise invalid("'background': true needs 'store': true (a background response is polled from the "
                      "store).", param="background")
    if req.background and req.stream:
        raise invalid("Streaming a background response is not supported yet; poll it with GET "
                      "/v1/responses/{id}.", param="stream")


def with_instructions(instructions: str | None, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": instructions}] if instructions is not None else []) + conversation


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"'{param}' must be a string.", param=param)
    return value


def _format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("'text' must be an object with 'format'.", param="text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise invalid("'text.format.type' must be text, json_object or json_schema.", param="text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


@dataclass(slots=True)
class ResponsesShape:
    """A Response object for one request (the chat shapes' counterpart); its items come from `OutputItems`."""

    id: str
    created: int
    model: str
    req: GenerationRequest

    def response(self, status: str, output: list[dict], finish_reason: str | None = None,
                 usage: Usage | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": req.background, "error": error, "incomplete_details": incomplete,
                "max_output_tokens": req.max_tokens, "model": self.model, "output": output,
                "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store,
                "instructions": req.instructions, "temperature": req.temperature,
                "text": {"format": {"type": "text"}}, **self._tool_fields(), "top_p": req.top_p,
                "truncation": "disabled", "metadata": {}, "usage": None if usage is None else _usage(usage)}

    def _tool_fields(self) -> dict[str, Any]:
        tools = self.req.tools
        if tools is None:
            return {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
        listed = [{"type": "function", "name": t["name"], "description": t.get("description"),
                   "parameters": t["parameters"], "strict": True} for t in tools.tools]
        choice: str | dict = tools.choice if tools.choice in ("none", "auto", "required") else \
            {"type": "function", "name": tools.choice}
        return {"tools": listed, "tool_choice": choice, "parallel_tool_calls": tools.parallel}

    def output_items(self) -> OutputItems:
        tools = self.req.tools
        active = tools is not None and tools.active
        return OutputItems(self.item_id, ToolCallStream(self.id) if active else None)

    def full(self, text: str, finish_reason: str, usage: Usage, logprobs: list[TokenLogprob] | None) -> dict:
        items = self.output_items()
        items.feed(text)
        status = final_status(finish_reason)
        items.finish(status)
        return self.response(status, items.items, finish_reason, usage)

    @property
    def item_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")


def final_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def new_shape(model: str, req: GenerationRequest) -> ResponsesShape:
    return ResponsesShape("resp_" + uuid.uuid4().hex, int(time.time()), model, req)
