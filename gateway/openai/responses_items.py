"""Responses API items and tools mapped onto the chat path's messages and tool records, and back."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.tool_output import ToolCallStream
from gateway.web.api_errors import invalid

_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
_CALL_KEYS = frozenset({"type", "id", "call_id", "name", "arguments", "status"})
_OUTPUT_KEYS = frozenset({"type", "id", "call_id", "output", "status"})
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_CHAT_PARAM = re.compile(r"messages\[(\d+)\]")


def chat_tools(raw: Any) -> Any:
    """Responses function tools (flat) as chat tools (under `function`); any other tool type is a 400."""
    if not isinstance(raw, list):
        return raw  # the chat parser names the type error
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            shown = f"type {kind[:40]!r}" if isinstance(kind, str) else "no function type"
            raise invalid(f"Only function tools are supported; tools[{i}] has {shown} (web_search, "
                          "file_search and the other hosted tools are not served).", param="tools")
        for key in tool:
            if key not in _TOOL_KEYS:
                raise invalid(f"Unrecognized argument in a function tool: {key}", param=f"tools[{i}].{key}")
        out.append({"type": "function",
                    "function": {k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out


def chat_tool_choice(value: Any) -> Any:
    """`{"type": "function", "name"}` as the chat path's `{"type": "function", "function": {"name"}}`."""
    if value is None or isinstance(value, str):
        return value  # the chat parser checks the words
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"} \
            and isinstance(value["name"], str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.",
                  param="tool_choice")


def responses_param(param: str, origins: list[str]) -> str:
    """A chat parser's param in the Responses request's terms (`messages[3]` -> its `input[i]`)."""
    param = param.replace(".function.", ".").replace(".function", "")
    m = _CHAT_PARAM.match(param)
    if m is None:
        return param
    index = int(m.group(1))
    where = origins[index] if index < len(origins) else "input"
    return where + param[m.end():]


def chat_messages(raw: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """`input` (a string or items) as chat messages, with the index of the input item each came from."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], [0]
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a non-empty array of items.", param="input")
    out: list[dict[str, Any]] = []
    origins: list[int] = []
    after_call = False  # the item before was a function_call: consecutive calls make one assistant turn
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call" and after_call:
            out[-1]["tool_calls"].append(_call(item, param))
            continue
        after_call = kind == "function_call"
        if kind == "message":
            msg = _message(item, param)
        elif kind == "function_call":
            msg = {"role": "assistant", "content": None, "tool_calls": [_call(item, param)]}
        elif kind == "function_call_output":
            msg = _call_output(item, param)
        else:
            raise invalid("Only message, function_call and function_call_output items are supported in "
                          "'input'.", param=param)
        out.append(msg)
        origins.append(i)
    return out, origins


def _unknown(item: dict, allowed: frozenset[str], param: str) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise invalid(f"Unrecognized field in an input item: {extra[0]}", param=f"{param}.{extra[0]}")


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"'{key}' must be a string.", param=f"{param}.{key}")
    return value


def _parts_text(content: Any, param: str, kinds: tuple[str, ...]) -> Any:
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if (not isinstance(part, dict) or part.get("type") not in kinds
                or not isinstance(part.get("text"), str)):
            raise invalid(f"Only text content parts ({', '.join(kinds)}) are supported.",
                          param=f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _message(item: dict, param: str) -> dict[str, Any]:
    _unknown(item, _MESSAGE_KEYS, param)
    content = _parts_text(item.get("content"), f"{param}.content", ("input_text", "output_text"))
    return {"role": item.get("role"), "content": content}


def _call(item: dict, param: str) -> dict[str, Any]:
    _unknown(item, _CALL_KEYS, param)
    return {"id": _string(item, "call_id", param), "type": "function",
            "function": {"name": _string(item, "name", param),
                         "arguments": _string(item, "arguments", param)}}


def _call_output(item: dict, param: str) -> dict[str, Any]:
    _unknown(item, _OUTPUT_KEYS, param)
    call_id = _string(item, "call_id", param)
    output = _parts_text(item.get("output"), f"{param}.output", ("input_text",))
    if not isinstance(output, str):
        raise invalid("'output' must be a string or an array of input_text parts.", param=f"{param}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def input_items(conversation: list[dict[str, Any]], new: int) -> list[dict]:
    """The last `new` turns of a conversation (chat messages) as the Responses API's input items."""
    items: list[dict] = []
    for msg in conversation[len(conversation) - new:]:
        if msg["role"] == "tool":
            items.append({"id": "fco", "type": "function_call_output", "call_id": msg["tool_call_id"],
                          "output": msg["content"], "status": "completed"})
            continue
        if msg["content"] or not msg.get("tool_calls"):
            kind = "output_text" if msg["role"] == "assistant" else "input_text"
            items.append({"id": "msg", "type": "message", "role": msg["role"], "status": "completed",
                          "content": [{"type": kind, "text": msg["content"]}]})
        items += [function_call("fc", c["id"], c["name"], c["arguments"], "completed")
                  for c in msg.get("tool_calls", ())]
    for i, item in enumerate(items):
        item["id"] = f"{item['id']}_{i:04d}"
    return items


def assistant_turn(output: list[dict]) -> dict[str, Any]:
    """A response's output items as the assistant turn its stored conversation continues from."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": i["call_id"], "name": i["name"], "arguments": i["arguments"]}
             for i in output if i["type"] == "function_call"]
    if calls:
        turn["tool_calls"] = calls
    return turn


def function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def message(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


Event = tuple[str, dict[str, Any]]  # a stream event's type and its fields (sequence_number is added on send)


@dataclass(slots=True)
class OutputItems:
    """A response's output items as its text arrives: one message, or function calls when tools are on. Each
    step returns the stream events it makes; `items` holds the finished items."""

    message_id: str
    tools: ToolCallStream | None
    items: list[dict] = field(default_factory=list)
    _open: dict | None = None  # the item being written (its text or arguments grow)
    _text: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        if self.tools is None:
            return self._text_delta(text)
        content, deltas = self.tools.feed(text)
        return self._text_delta(content) + self._call_deltas(deltas)

    def finish(self, status: str = "completed") -> list[Event]:
        """Close what is open, the last item with `status`; an empty reply is one empty message."""
        events: list[Event] = []
        if self.tools is not None:
            content, deltas = self.tools.finish()
            events = self._text_delta(content) + self._call_deltas(deltas)
        if self._open is None and not self.items:
            events += self._start_message()
        return events + self._close(status)

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _start_message(self) -> list[Event]:
        self._open = message(self.message_id, None, "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        return [("response.output_item.added", {"output_index": len(self.items), "item": dict(self._open)}),
                ("response.content_part.added", {**self._where(), "content_index": 0, "part": part})]

    def _text_delta(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self._start_message() if self._open is None else []
        self._text.append(text)
        return events + [("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text,
                                                         "logprobs": []})]

    def _call_deltas(self, deltas: list[dict]) -> list[Event]:
        events: list[Event] = []
        for d in deltas:
            if "id" in d:
                events += self._close("completed")
                self._open = function_call("fc_" + d["id"].removeprefix("call_"), d["id"],
                                           d["function"]["name"], "", "in_progress")
                events.append(("response.output_item.added", {"output_index": len(self.items),
                                                              "item": dict(self._open)}))
            piece = d["function"]["arguments"]
            if piece:
                assert self._open is not None
                self._open["arguments"] += piece
                events.append(("response.function_call_arguments.delta", {**self._where(), "delta": piece}))
        return events

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        if item["type"] == "message":
            text = "".join(self._text)
            item = message(item["id"], text, status)
            events: list[Event] = [
                ("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []}),
                ("response.content_part.done", {**where, "content_index": 0, "part": item["content"][0]})]
        else:
            item = {**item, "status": status}
            events = [("response.function_call_arguments.done", {**where, "arguments": item["arguments"]})]
        self.items.append(item)
        self._open = None
        return events + [("response.output_item.done", {"output_index": where["output_index"], "item": item})]
