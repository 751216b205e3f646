"""What a constrained request asks the sampler to produce, checked before any token is drawn.

A `GrammarSpec` is the wire form (kind + schema); it is validated here without a tokenizer so the
gateway can answer 400 with the offending `param`, and turned into an llguidance grammar string.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import llguidance

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64
MAX_TOOLS = 128
# Output layout: json.dumps' default separators, no free whitespace (so a finished value ends the grammar).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_OPEN, TOOL_CLOSE = "<tool_call>\n", "\n</tool_call>"
SCHEMA_PARAM = "response_format.json_schema.schema"

GrammarKind = Literal["json_object", "json_schema", "tool_call"]
ToolStyle = Literal["hermes", "json"]


class GrammarError(ValueError):
    """A schema or tool list that cannot be used; `param` names the request field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """kind + canonical JSON `body` (a schema, or a tool-call descriptor); `digest` keys compiled grammars."""

    kind: GrammarKind
    body: str
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        text = f"{self.kind}\n{self.body}".encode()
        object.__setattr__(self, "digest", hashlib.sha256(text).hexdigest())

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "body": self.body}

    @classmethod
    def from_dict(cls, d: object, param: str = "response_format") -> GrammarSpec:
        """Rebuild from the wire and re-check it (the worker trusts no frame)."""
        if not isinstance(d, dict) or not isinstance(d.get("body"), str) or set(d) != {"kind", "body"}:
            raise GrammarError("grammar must be a map with 'kind' and 'body'", param)
        try:
            body = json.loads(d["body"])
        except ValueError:
            raise GrammarError("grammar body is not JSON", param) from None
        if d["kind"] == "json_object":
            return json_object_spec()
        if d["kind"] == "json_schema":
            return json_schema_spec(body, param)
        if d["kind"] == "tool_call" and isinstance(body, dict):
            return tool_call_spec(body.get("tools"), body.get("style", "hermes"),
                                  parallel=body.get("parallel") is True, auto=body.get("auto") is True,
                                  param=param)
        raise GrammarError(f"unknown grammar kind {d['kind']!r}", param)


MAX_WIRE_BODY_BYTES = 4 * MAX_SCHEMA_BYTES  # a spec body on the wire: JSON escapes may grow the schema's text
GRAMMAR_KINDS = ("json_object", "json_schema", "tool_call")


def wire_key(d: object, param: str = "response_format") -> tuple[str, str]:
    """(kind, body) of a wire map after a shape check only (no JSON parse, no llguidance, no hash of the
    body): cheap enough for the worker loop, and exact as a cache key (dict lookups compare the whole
    body)."""
    if not isinstance(d, dict) or set(d) != {"kind", "body"} or not isinstance(d["body"], str) \
            or d["kind"] not in GRAMMAR_KINDS:
        raise GrammarError("grammar must be a map with a known 'kind' and a string 'body'", param)
    if len(d["body"]) > MAX_WIRE_BODY_BYTES:
        raise GrammarError(f"grammar body exceeds {MAX_WIRE_BODY_BYTES} bytes", param)
    return d["kind"], d["body"]


def canonical_json(value: object) -> str:
    """Compact JSON that keeps key order (property order decides the output order)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def json_object_spec() -> GrammarSpec:
    return GrammarSpec("json_object", canonical_json({"type": "object"}))


def json_schema_spec(schema: object, param: str = SCHEMA_PARAM) -> GrammarSpec:
    """Validate a user JSON schema (type, size, depth, keywords llguidance implements) into a spec."""
    body = _checked_schema(schema, param)
    _check_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), param)
    return GrammarSpec("json_schema", body)


def tool_call_spec(tools: object, style: str = "hermes", *, parallel: bool = False, auto: bool = False,
                   param: str = "tools") -> GrammarSpec:
    """A call to one of `tools` ([{"name", "parameters"}]): `{"name": ..., "arguments": {...}}`,
    wrapped in <tool_call> tags for Hermes-style chat templates; `parallel` allows several calls;
    `auto` (Hermes style only) also allows plain text that does not start with a tool-call tag."""
    if style not in ("hermes", "json"):
        raise GrammarError(f"unknown tool-call style {style!r}", param)
    if auto and style != "hermes":
        raise GrammarError("text-or-call grammars need the hermes style", param)
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise GrammarError(f"tools must be a list of 1 to {MAX_TOOLS} functions", param)
    checked = []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}].function"
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise GrammarError("each tool needs a non-empty string name", f"{where}.name")
        params = tool.get("parameters", {"type": "object"})
        _checked_schema(params, f"{where}.parameters")
        checked.append({"name": tool["name"], "parameters": params})
    shape = {"tools": checked, "style": style, "parallel": parallel}
    body = canonical_json({**shape, "auto": True} if auto else shape)  # same digest as before for non-auto
    if len(body.encode()) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"tool schemas exceed {MAX_SCHEMA_BYTES} bytes in all", param)
    spec = GrammarSpec("tool_call", body)
    _check_grammar(grammar_text(spec), param)
    return spec


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of one call to any of `tools`."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar (JSON-schema or Lark form) that `spec` stands for."""
    if spec.kind != "tool_call":
        return llguidance.LLMatcher.grammar_from_json_schema(json.loads(spec.body), defaults=JSON_OPTIONS)
    return llguidance.LLMatcher.grammar_from_lark(lark_text(spec))


def lark_text(spec: GrammarSpec) -> str:
    """`spec` as llguidance Lark text (JSON schemas inline through `%json`, with the same output layout)."""
    body = json.loads(spec.body)
    if spec.kind != "tool_call":
        return f"start: %json {canonical_json({**body, 'x-guidance': JSON_OPTIONS})}\n"
    schema = {**call_schema(body["tools"]), "x-guidance": JSON_OPTIONS}
    call = f"%json {canonical_json(schema)}"
    if body["style"] == "hermes":
        call = f"{json.dumps(TOOL_OPEN)} {call} {json.dumps(TOOL_CLOSE)}"
    start = 'calls: call ("\\n" call)*' if body["parallel"] else "calls: call"
    # `auto`: free text, unless it opens with a tool-call tag (then it must be well-formed calls)
    head = "start: TEXT | calls\nTEXT: /(.|\\n)*/ & ~/\\s*<tool_call>(.|\\n)*/\n" if body.get("auto") \
        else "start: calls\n"
    return f"{head}{start}\ncall: {call}\n"


def _checked_schema(schema: object, param: str) -> str:
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object", param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
    try:
        body = canonical_json(schema)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"JSON schema is not serializable JSON: {e}", param) from None
    if len(body.encode()) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"JSON schema exceeds {MAX_SCHEMA_BYTES} bytes serialized", param)
    return body


def _depth(value: object) -> int:
    """Nesting depth of dicts/lists, without recursion (a hostile schema cannot blow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_SCHEMA_DEPTH:
            break
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, d + 1) for c in children if isinstance(c, dict | list))
    return deepest


def _check_grammar(grammar: str, param: str) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        text = messages[0] if messages else "invalid grammar"
        if text.startswith("Unimplemented keys"):
            text = "unsupported JSON schema keyword(s): " + text.partition(":")[2].strip()
        raise GrammarError(f"invalid JSON schema: {text.splitlines()[0][:300]}", param)
