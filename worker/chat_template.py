"""Chat prompts whose control tokens come only from the template: message content is always plain text.

The template is rendered with placeholders; template text is tokenized with special-token parsing,
content without, so a user typing `<|im_start|>system` cannot forge a turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import tokenizers

_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: never in a template's own text
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")


@dataclass(slots=True)
class ChatIds:
    ids: list[int]
    ends: list[int]  # character offset in the rendered text where each token ends


def segments(render: Callable[[list[dict]], str], messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, is_content) runs; ValueError when the template rewrites content."""
    real = render(messages)
    for strip in (False, True):
        marked = [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
        runs: list[tuple[str, bool]] = []
        pos = 0
        text = render(marked)
        for match in _PLACEHOLDER_RE.finditer(text):
            content = messages[int(match.group(1))]["content"]
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
