"""Chat prompts whose control tokens come only from the template: message content is always plain text.

The template is rendered with placeholders; template text is tokenized with special-token parsing,
content without, so a user typing `<|im_start|>system` cannot forge a turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import tokenizers

_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: never in a template's own text
PLACEHOLDER_CHARS = ("\ue000", "\ue001")  # refused in what a template renders beside message content
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")


@dataclass(slots=True)
class ChatIds:
    ids: list[int]
    ends: list[int]  # character offset in the rendered text where each token ends


def segments(render: Callable[[list[dict]], str], messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, is_content) runs; ValueError when the template rewrites content."""
    real = render(messages)
    for strip in (False, True):
        # empty content holds no user text; left as it is, templates that skip it render the same
        marked = [{**m, "content": _PLACEHOLDER.format(i)} if m.get("content") else m
                  for i, m in enumerate(messages)]
        runs: list[tuple[str, bool]] = []
        pos = 0
        text = render(marked)
        for match in _PLACEHOLDER_RE.finditer(text):
            index = int(match.group(1))
            if index >= len(messages) or not messages[index].get("content"):  # not one of ours
                raise ValueError("the rendered prompt holds content markers the gateway did not place")
            content = messages[index]["content"]
            runs += [(text[pos:match.start()], False), (content.strip() if strip else content, True)]
            pos = match.end()
        runs.append((text[pos:], False))
        if "".join(t for t, _ in runs) == real:
            return [r for r in runs if r[0]]
    raise ValueError("the chat template transforms message content in a way the gateway cannot isolate")


class SegmentEncoder:
    """Encodes (text, is_content) runs; only template runs may produce special-token ids."""

    def __init__(self, hf: tokenizers.Tokenizer) -> None:
        self._plain = tokenizers.Tokenizer.from_str(hf.to_str())
        self._plain.encode_special_tokens = True  # special tokens in the text stay text
        specials = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self._special_ids = specials
        names = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None

    def encode(self, runs: list[tuple[str, bool]]) -> ChatIds:
        out = ChatIds([], [])
        buf: list[str] = []
        start = pos = 0
        for text, is_content in runs:
            cuts = [] if is_content or self._special_re is None else list(self._special_re.finditer(text))
            last = 0
            for m in cuts:
                buf.append(text[last:m.start()])
                self._flush(out, "".join(buf), start)
                buf = []
                out.ids.append(self._special_ids[m.group()])
                out.ends.append(pos + m.end())
                start, last = pos + m.end(), m.end()
            buf.append(text[last:])
            pos += len(text)
        self._flush(out, "".join(buf), start)
        return out

    def _flush(self, out: ChatIds, text: str, start: int) -> None:
        if not text:
            return
        enc = self._plain.encode(text, add_special_tokens=False)
        out.ids.extend(enc.ids)
        out.ends.extend(start + end for _, end in enc.offsets)


# ---- tools, for templates without a tools section (SmolLM2's): a Hermes-style system block ----

TOOLS_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def tool_call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (`arguments` is the JSON text the client sent back)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        args = json.dumps(arguments, ensure_ascii=False)  # not JSON: keep it, as a string
    return (f"<tool_call>\n{{\"name\": {json.dumps(name, ensure_ascii=False)}, "
            f"\"arguments\": {args}}}\n</tool_call>")


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Plain role/content messages for a template that knows no tools: the tool list joins the system
    message, assistant `tool_calls` become <tool_call> blocks, `tool` results <tool_response> blocks.
    All of it is message content, so none of it can produce control tokens."""
    out: list[dict] = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join(tool_call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools:
        listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                            for t in tools)
        block = TOOLS_PREAMBLE.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# ---- tools, for templates with their own tools section (they read `tools` and `message.tool_calls`) ----

def native_messages(messages: list[dict]) -> list[dict]:
    """Messages in the shape such templates expect: `tool_calls` as OpenAI function calls whose
    `arguments` is the parsed JSON object when it parses (HF's convention), else the text."""
    out = []
    for m in messages:
        if not m.get("tool_calls"):
            out.append(m)
            continue
        calls = []
        for c in m["tool_calls"]:
            try:
                args = json.loads(c["arguments"])
            except ValueError:
                args = c["arguments"]
            calls.append({"id": c["id"], "type": "function",
                          "function": {"name": c["name"], "arguments": args}})
        out.append({**m, "tool_calls": calls})
    return out


def special_texts(hf: tokenizers.Tokenizer) -> tuple[str, ...]:
    """The text of every special token: none may appear in what a template renders outside message content."""
    return tuple(t.content for t in hf.get_added_tokens_decoder().values() if t.special)
