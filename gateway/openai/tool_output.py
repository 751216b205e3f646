"""Response side of tool calling: a choice's text split, as it streams, into content and OpenAI tool calls.

The call grammar (worker.protocol.grammar_spec, Hermes style) makes a reply either plain text or calls only,
each `<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>`, calls separated by a newline; compact
JSON holds no raw newline, so the first `}\\n</tool_call>` ends the arguments.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass, field

OPEN = "<tool_call>"
_END = "}\n</tool_call>"
_HEAD = re.compile(r'\n?<tool_call>\n\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


def call_id(seed: str = "", index: int = 0) -> str:
    """A call's id: random, or (`seed`: its response and choice) the same each time that choice's text is
    parsed, so a stream carried on by another gateway names its calls as its first gateway did."""
    if not seed:
        return "call_" + secrets.token_hex(12)
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallStream:
    """Feed a choice's text deltas; get back (content text, tool-call deltas) to send now."""

    id_seed: str = ""  # call ids derive from it and the call's index ("": random)
    mode: str = "start"  # start: undecided | text | calls
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _pos: int = 0  # calls mode: first unconsumed character of _buf
    _args_sent: int = -1  # calls mode, inside arguments: how far they were sent; -1 between calls

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.mode == "text":
            return text, []
        self._buf += text
        if self.mode == "start":
            if OPEN.startswith(self._buf):
                return "", []  # could still open a call
            if not self._buf.startswith(OPEN):
                self.mode, text, self._buf = "text", self._buf, ""
                return text, []
            self.mode = "calls"
        return "", self._scan()

    def finish(self) -> tuple[str, list[dict]]:
        """At the end of the choice: what is still held back (a cut call's arguments go out as they are)."""
        if self.mode == "start":
            self.mode, text, self._buf = "text", self._buf, ""
            return text, []
        if self.mode == "calls" and self._args_sent >= 0:
            rest = self._buf[self._args_sent:]
            self.calls[-1].arguments += rest
            self._args_sent = len(self._buf)
            return "", [{"index": len(self.calls) - 1, "function": {"arguments": rest}}] if rest else []
        return "", []

    def _scan(self) -> list[dict]:
        out: list[dict] = []
        while True:
            buf = self._buf
            if self._args_sent < 0:
                m = _HEAD.match(buf, self._pos)
                if m is None:
                    return out
                self.calls.append(ToolCall(call_id(self.id_seed, len(self.calls)), m.group(1)))
                out.append({"index": len(self.calls) - 1, "id": self.calls[-1].id, "type": "function",
                            "function": {"name": m.group(1), "arguments": ""}})
                self._pos = self._args_sent = m.end()
                continue
            end = buf.find(_END, self._args_sent)
            upto = end if end >= 0 else max(self._args_sent, len(buf) - len(_END) + 1)
            piece = buf[self._args_sent:upto]
            if piece:
                self.calls[-1].arguments += piece
                out.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            self._args_sent = upto
            if end < 0:
                return out
            self._pos, self._args_sent = end + len(_END), -1
