"""Request side of tool calling: `tools`, `tool_choice`, `parallel_tool_calls` and the tool turns of a
conversation, checked into plain records, and the call grammar the worker enforces."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.web.api_errors import invalid
from worker.protocol import GrammarError, GrammarSpec, tool_call_spec
from worker.protocol.grammar_spec import MAX_SCHEMA_BYTES

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CHOICES = ("none", "auto", "required")


@dataclass(slots=True)
class ToolRequest:
    """The tools offered and how the model may use them (`choice`: none | auto | required | a name)."""

    tools: list[dict[str, Any]]  # [{"name", "description"?, "parameters"}] in request order
    choice: str
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> GrammarSpec | None:
        """The call grammar: required/named = calls only; auto = text or calls; none = unconstrained."""
        if not self.active:
            return None
        offered = self.tools if self.choice in ("auto", "required") else \
            [t for t in self.tools if t["name"] == self.choice]
        try:
            return tool_call_spec([{"name": t["name"], "parameters": t["parameters"]} for t in offered],
                                  "hermes", parallel=self.parallel and self.choice in ("auto", "required"),
                                  auto=self.choice == "auto")
        except GrammarError as e:
            raise invalid(e.message, param=e.param) from None


def parse_tools(body: dict) -> ToolRequest | None:
    """None when the request offers no tools (then `tool_choice` may only be absent or "none")."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise invalid("'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid(f"'tools' must be an array of at most {MAX_TOOLS} tools.", param="tools")
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("Tool names must be unique.", param="tools")
    req = ToolRequest(tools, _choice(choice, names), parallel is not False)
    _check_total_size(tools)  # before any schema is compiled: a big set costs its sender one serialization
    for i, t in enumerate(tools):  # each schema must compile on its own, so the error names its tool
        try:
            tool_call_spec([{"name": t["name"], "parameters": t["parameters"]}], "hermes")
        except GrammarError as e:
            where = f"tools[{i}].function.parameters" if e.param == "tools" else \
                e.param.replace("tools[0]", f"tools[{i}]", 1)
            raise invalid(e.message, param=where) from None
    return req


def _check_total_size(tools: list[dict[str, Any]]) -> None:
    try:
        size = sum(len(json.dumps(t["parameters"], separators=(",", ":"), ensure_ascii=False).encode())
                   for t in tools)
    except (TypeError, ValueError):
        return  # not JSON: the per-tool check names the tool
    if size > MAX_SCHEMA_BYTES:
        raise invalid(f"Tool schemas exceed {MAX_SCHEMA_BYTES} bytes in all.", param="tools")


def _tool(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict) or value.get("type") != "function" or set(value) - {"type", "function"}:
        raise invalid("Each tool must be {'type': 'function', 'function': {...}}.", param=param)
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise invalid("'function' must be an object.", param=f"{param}.function")
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise invalid(f"Unrecognized argument in a function: {key}", param=f"{param}.function.{key}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid("A function name must be 1-64 letters, digits, '_' or '-'.",
                      param=f"{param}.function.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise invalid("'description' must be a string.", param=f"{param}.function.description")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise invalid("'strict' must be a boolean.", param=f"{param}.function.strict")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid("'parameters' must be a JSON schema object.", param=f"{param}.function.parameters")
    out: dict[str, Any] = {"name": name}
    if desc:
        out["description"] = desc
    out["parameters"] = params
    return out


def _choice(value: Any, names: list[str]) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in _CHOICES:
            raise invalid("'tool_choice' must be 'none', 'auto', 'required' or a named function.",
                          param="tool_choice")
        return value
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid("'tool_choice' must be {'type': 'function', 'function': {'name': ...}}.",
                      param="tool_choice")
    if name not in names:
        raise invalid(f"'tool_choice' names function {name[:64]!r}, which is not in 'tools'.",
                      param="tool_choice")
    return name


def message_tool_calls(msg: dict, param: str) -> list[dict[str, str]]:
    """An assistant message's `tool_calls` as [{"id", "name", "arguments"}]."""
    raw = msg.get("tool_calls")
    if not isinstance(raw, list) or not raw:
        raise invalid("'tool_calls' must be a non-empty array.", param=f"{param}.tool_calls")
    out = []
    for i, call in enumerate(raw):
        where = f"{param}.tool_calls[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function" \
                or not isinstance(call.get("id"), str):
            raise invalid("A tool call needs 'id', 'type': 'function' and 'function'.", param=where)
        if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise invalid("A tool call's function needs string 'name' and 'arguments'.",
                          param=f"{where}.function")
        out.append({"id": call["id"], "name": fn["name"], "arguments": fn["arguments"]})
    return out
