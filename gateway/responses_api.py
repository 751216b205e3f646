"""`POST /v1/responses` over the chat path: a Responses request is validated and translated into a chat request
(the same tokenization, admission, routing and sampling), and its result is shaped as a Response object or as the
typed stream events the `openai` SDK parses (`response.created` ... `response.completed`, with `sequence_number`).

Stored responses (`store`, default true) and `previous_response_id` go through `gateway.response_store`. Not served yet, each refused with a
400 naming the field: `conversation`, `tools`, `background`, `include`, `prompt`, non-message input items;
`reasoning` is accepted and ignored (the served models do not reason).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.errors import ApiError, invalid
from gateway.responses import TokenLogprob, Usage
from gateway.schemas import GenerationRequest, parse_chat
from gateway.sse import event_named

if TYPE_CHECKING:
    from gateway.generation import Delta, Generation

FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                    "store", "metadata", "user", "text", "reasoning", "tool_choice", "parallel_tool_calls",
                    "prompt_cache_key", "safety_identifier", "service_tier", "truncation",
                    "previous_response_id"})
NOT_YET = frozenset({"conversation", "tools", "background", "include", "prompt",
                     "stream_options", "top_logprobs", "max_tool_calls"})
_PASSED_ON = ("model", "temperature", "top_p", "stream", "metadata", "user", "prompt_cache_key",
              "safety_identifier", "service_tier")


def parse_responses(body: Any) -> GenerationRequest:
    """The chat request a Responses body asks for (400 naming the field otherwise)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    for name in body:
        if name in NOT_YET:
            raise invalid(f"'{name}' is not supported by this server's Responses API yet.", param=name)
        if name not in FIELDS:
            raise invalid(f"Unrecognized request argument supplied: {name}", param=name)
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise invalid("'tool_choice' needs tools, which this server's Responses API does not take yet.",
                      param="tool_choice")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("Only 'truncation': 'disabled' is supported.", param="truncation")
    chat: dict[str, Any] = {k: body[k] for k in _PASSED_ON if k in body}
    instructions = _text(body["instructions"], "instructions") if body.get("instructions") is not None else None
    conversation = _input_messages(body.get("input"))
    chat["messages"] = with_instructions(instructions, conversation)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    try:
        req = parse_chat(chat)
    except ApiError as exc:  # name the Responses field, not the chat one it became
        exc.param = _PARAMS.get(exc.param or "", exc.param)
        raise
    req.api, req.instructions = "responses", instructions
    req.conversation = req.messages[1:] if instructions is not None else req.messages
    req.new_turns = len(req.conversation)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous.startswith("resp_")):
        raise invalid("'previous_response_id' must be a response id (resp_...).", param="previous_response_id")
    req.previous_response_id = previous
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise invalid("'store' must be a boolean.", param="store")
    req.store = store
    return req


def with_instructions(instructions: str | None, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": instructions}] if instructions is not None else []) + conversation


def input_items(conversation: list[dict[str, Any]], new: int) -> list[dict]:
    """The last `new` turns of a conversation as the Responses API's input items."""
    items = []
    for i, msg in enumerate(conversation[len(conversation) - new:]):
        kind = "output_text" if msg["role"] == "assistant" else "input_text"
        items.append({"id": f"msg_{i:04d}", "type": "message", "role": msg["role"], "status": "completed",
                      "content": [{"type": kind, "text": msg["content"]}]})
    return items


_PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"'{param}' must be a string.", param=param)
    return value


def _input_messages(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a non-empty array of message items.", param="input")
    out = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise invalid("Only message items are supported in 'input' yet.", param=param)
        if set(item) - {"type", "role", "content", "id", "status"}:
            name = sorted(set(item) - {"type", "role", "content", "id", "status"})[0]
            raise invalid(f"Unrecognized field in an input item: {name}", param=f"{param}.{name}")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                        or not isinstance(part.get("text"), str):
                    raise invalid("Only text content parts (input_text, output_text) are supported.",
                                  param=f"{param}.content[{j}]")
                parts.append(part["text"])
            content = "".join(parts)
        out.append({"role": item.get("role"), "content": content})
    return out


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
    """A Response object and its stream events for one request (the chat shapes' counterpart)."""

    id: str
    created: int
    model: str
    req: GenerationRequest

    def response(self, status: str, text: str | None, finish_reason: str | None, usage: Usage | None) -> dict:
        output = [] if text is None else [self._message(text, "completed")]
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "max_output_tokens":
                self.req.max_tokens, "model": self.model, "output": output, "parallel_tool_calls": False,
                "previous_response_id": self.req.previous_response_id, "reasoning": None,
                "store": self.req.store, "instructions": self.req.instructions,
                "temperature": self.req.temperature, "text": {"format": {"type": "text"}}, "tool_choice": "none",
                "tools": [], "top_p": self.req.top_p, "truncation": "disabled", "metadata": {},
                "usage": None if usage is None else _usage(usage)}

    def full(self, text: str, finish_reason: str, usage: Usage, logprobs: list[TokenLogprob] | None) -> dict:
        return self.response("incomplete" if finish_reason == "length" else "completed", text, finish_reason,
                             usage)

    @property
    def item_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def _message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == \
            "completed" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def new_shape(model: str, req: GenerationRequest) -> ResponsesShape:
    return ResponsesShape("resp_" + uuid.uuid4().hex, int(time.time()), model, req)


async def stream_events(gen: Generation, first: Delta | None, trace: Any,
                        save: Callable[[dict, str], Awaitable[bool]]) -> AsyncIterator[bytes]:
    """The typed events of one streamed response, numbered from 0; an error mid-stream is an `error` event."""
    shape: ResponsesShape = gen.prepared.shape  # type: ignore[assignment]
    seq = 0

    def emit(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return event_named(kind, {"type": kind, "sequence_number": seq - 1, **fields})

    where = {"item_id": shape.item_id, "output_index": 0, "content_index": 0}
    yield emit("response.created", response=shape.response("in_progress", None, None, None))
    yield emit("response.in_progress", response=shape.response("in_progress", None, None, None))
    yield emit("response.output_item.added", output_index=0, item=shape._message("", "in_progress"))
    yield emit("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
    parts: list[str] = []
    delta, finish = first, None
    try:
        while delta is not None:
            if delta.finish_reason is not None:
                finish = delta.finish_reason
                await gen.close()  # settle before the client can see the end
            if delta.text:
                parts.append(delta.text)
                yield emit("response.output_text.delta", **where, delta=delta.text, logprobs=[])
            delta = await gen.next()
            trace.next_chunk(gen.usage.completion_tokens)
    except ApiError as exc:
        err = exc.body()["error"]
        yield emit("error", code=err["code"], message=err["message"], param=err["param"])
        return
    text = "".join(parts)
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    yield emit("response.output_text.done", **where, text=text, logprobs=[])
    yield emit("response.content_part.done", **where, part=part)
    yield emit("response.output_item.done", output_index=0, item=shape._message(text, "completed"))
    done = shape.full(text, finish or "stop", gen.usage, None)
    done["store"] = await save(done, text)
    yield emit("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)
