"""Incremental, UTF-8-safe detokenization and stop-string matching for streams.

Works on token bytes, so a character split across tokens never shows as U+FFFD and a stop string
split across chunks is never emitted.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in char -> byte value."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = visible[:]
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def _is_byte_level(hf) -> bool:
    return "ByteLevel" in repr(getattr(hf, "decoder", None))


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    if byte_level:
        table = _byte_level_decoder()
        try:
            return bytes(table[ch] for ch in piece)
        except KeyError:
            return piece.encode("utf-8")
    m = _BYTE_FALLBACK.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def token_byte_table(hf, size: int | None = None) -> list[bytes]:
    """Bytes of every token id of a `tokenizers.Tokenizer` (special tokens -> b"").

    `size` pads the table to the model's vocabulary size (ids without a piece -> b"").
    """
    vocab = hf.get_vocab(with_added_tokens=True)
    size = max(size or 0, hf.get_vocab_size(with_added_tokens=True))
    table = [b""] * size
    byte_level = _is_byte_level(hf)
    for piece, idx in vocab.items():
        if 0 <= idx < size:
            table[idx] = _piece_bytes(piece, byte_level)
    for idx, added in hf.get_added_tokens_decoder().items():
        if 0 <= idx < size:
            table[idx] = b"" if added.special else added.content.encode("utf-8")
    return table


class IncrementalDetokenizer:
    """Token ids in, text out; multi-byte characters are emitted only once complete."""

    __slots__ = ("_table", "_decoder")

    def __init__(self, table: Sequence[bytes]) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_ids: Iterable[int]) -> str:
        table = self._table
        return self._decoder.decode(b"".join([table[i] for i in token_ids]))

    def flush(self) -> str:
        """Whatever is still pending at the end (a truncated character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Cuts a text stream at the first occurrence of any stop string."""

    __slots__ = ("_stops", "_hold", "_pending", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit now; sets `stopped` when a stop string was found."""
        if self.stopped or not text:
            return ""
        if not self._stops:
            return text
        buf = self._pending + text
        # Generation stops as soon as the text contains a stop string: take the occurrence that
        # ends first (then the longest), so the result does not depend on how text was chunked.
        found = [(i + len(s), i) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            cut = min(found)[1]
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        keep = len(buf) - self._hold
        if keep <= 0:
            self._pending = buf
            return ""
        self._pending = buf[keep:]
        return buf[:keep]

    def flush(self) -> str:
        """The held-back tail once the stream ended without a stop string."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
