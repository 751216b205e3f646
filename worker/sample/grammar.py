"""Grammar-constrained decoding on llguidance: grammars compiled off the step loop and cached by digest,
one matcher per sequence, and the batch's token bitmask applied to the logits in place.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from worker.protocol.grammar_spec import SCHEMA_PARAM, GrammarError, GrammarSpec, grammar_text, wire_key
from worker.text.tokenizer import Tokenizer

_PARAM = {"json_object": "response_format", "json_schema": SCHEMA_PARAM, "tool_call": "tools"}


def mask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: bit j of word w allows token 32 * w + j."""
    return (vocab_size + 31) // 32


def grammar_tokenizer(tok: Tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of `tok` (about 0.3 s: build once per model); `vocab_size` is the logits' width."""
    return llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=vocab_size or tok.vocab_size,
                                  eos_token=tok.eos_token_id)


class GrammarState:
    """One sequence's position in its grammar; advanced with every accepted token."""

    __slots__ = ("_matcher", "_words")

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._matcher = matcher
        self._words = words

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (CPU, contiguous int32, `mask_words(vocab)` long)."""
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous() \
                or row.numel() != self._words:
            raise ValueError(f"mask row must be a contiguous CPU int32 tensor of {self._words} words")
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and an error state) if the grammar forbids it."""
        return self._matcher.consume_token(int(token_id))

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (the value is complete), or EOS was accepted."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed now)."""
        return self._matcher.is_accepting()

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` accepted tokens (for speculative decoding)."""
        return self._matcher.rollback(num_tokens)

    @property
    def error(self) -> str | None:
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "grammar error"


@dataclass(slots=True, frozen=True)
class CompiledGrammar:
    """A compiled grammar: a matcher at the start, copied (cheaply) for every sequence."""

    spec: GrammarSpec
    prototype: llguidance.LLMatcher
    words: int

    def new_state(self) -> GrammarState:
        return GrammarState(self.prototype.deep_copy(), self.words)


def compile_grammar(tokenizer: llguidance.LLTokenizer, spec: GrammarSpec) -> CompiledGrammar:
    """Build the matcher for `spec` and check that some first token is allowed (GrammarError otherwise)."""
    param = _PARAM[spec.kind]
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid grammar: {matcher.get_error().splitlines()[0][:300]}", param)
    compiled = CompiledGrammar(spec, matcher, mask_words(tokenizer.vocab_size))
    probe = torch.zeros(compiled.words, dtype=torch.int32)
    compiled.new_state().fill_mask(probe)  # also warms the lexer for later copies
    if not bool(probe.any()):
        raise GrammarError("the JSON schema admits no value", param)
    return compiled


CacheKey = str | tuple[str, str]  # a checked spec's digest, or a wire map's (kind, body)


class GrammarBusy(Exception):
    """Too many compiles pending (`scope`: "worker" or "tenant"); the request may be retried."""

    def __init__(self, scope: str, limit: int) -> None:
        super().__init__(f"too many grammars compiling on this {scope} (limit {limit}); retry shortly")
        self.scope = scope


def compile_wire(tokenizer: llguidance.LLTokenizer, wire: dict) -> CompiledGrammar:
    """Validate a wire map (the worker trusts no frame) and compile it: one job on the pool thread."""
    return compile_grammar(tokenizer, GrammarSpec.from_dict(wire, param="response_format"))


class GrammarCache:
    """Compiled grammars by spec digest, least recently used dropped past `capacity`.

    `get` and `request` never block: they return a future completed by a small thread pool (llguidance
    releases the GIL while it compiles); a sequence waits for `future.done()` before it is scheduled.
    Failed compiles stay cached too, so a repeated bad schema fails at once. Compiles not yet done are
    bounded per cache (`max_pending`) and per tenant namespace (`max_pending_per_ns`) for `request`.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer | Callable[[], llguidance.LLTokenizer],
                 capacity: int = 64, threads: int = 2, max_pending: int = 16,
                 max_pending_per_ns: int = 4) -> None:
        """`tokenizer` may be a factory: it is then built (about 0.3 s) by the first compile job."""
        if capacity < 1 or max_pending < 1 or max_pending_per_ns < 1:
            raise ValueError("capacity and the pending bounds must be >= 1")
        self._tokenizer = tokenizer if isinstance(tokenizer, llguidance.LLTokenizer) else None
        self._make_tokenizer = tokenizer
        self.capacity = capacity
        self.max_pending = max_pending
        self.max_pending_per_ns = max_pending_per_ns
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[CacheKey, Future[CompiledGrammar]] = OrderedDict()
        self._pending: dict[CacheKey, bytes] = {}  # key -> namespace of the compiles not done yet
        self._lock = threading.RLock()  # re-entered by the done callback that `cancel` runs inside `abandon`
        self._tokenizer_lock = threading.Lock()  # held while a compile job builds the tokenizer (not _lock)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")

    def get(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """A checked spec's compile (in-process callers; no pending bound)."""
        return self._lookup(spec.digest, b"",
                            lambda: self._pool.submit(lambda: compile_grammar(self.tokenizer, spec)))

    def request(self, wire: dict, namespace: bytes) -> tuple[CacheKey, Future[CompiledGrammar]]:
        """A wire map's validation and compile, both off the caller's thread: (its key, the future). Raises
        GrammarError for a map of the wrong shape and GrammarBusy when a new compile would pass a bound."""
        key = wire_key(wire)
        return key, self._lookup(key, namespace,
                                 lambda: self._pool.submit(lambda: compile_wire(self.tokenizer, wire)))

    def warm(self) -> Future[llguidance.LLTokenizer]:
        """Build the tokenizer on the pool now. Its construction holds the GIL for about 0.5 s, so a server
        does this at start rather than inside its first constrained request."""
        return self._pool.submit(lambda: self.tokenizer)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = self._make_tokenizer()  # type: ignore[operator]
        return self._tokenizer

    def _lookup(self, key: CacheKey, namespace: bytes,
                submit: Callable[[], Future[CompiledGrammar]]) -> Future[CompiledGrammar]:
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return future
            if namespace:
                self._check_bounds(namespace)
            self.misses += 1
            future = submit()
            self._entries[key] = future
            self._pending[key] = namespace
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        future.add_done_callback(lambda _: self._settled(key))
        return future

    def _check_bounds(self, namespace: bytes) -> None:
        if len(self._pending) >= self.max_pending:
            raise GrammarBusy("worker", self.max_pending)
        if sum(ns == namespace for ns in self._pending.values()) >= self.max_pending_per_ns:
            raise GrammarBusy("tenant", self.max_pending_per_ns)

    def _settled(self, key: CacheKey) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def abandon(self, key: CacheKey) -> bool:
        """Nobody waits for this compile any more: cancel it if it has not started (True). A running one is
        left to finish (llguidance's parser limits bound it) and its result stays cached for a retry."""
        with self._lock:
            future = self._entries.get(key)
            if future is None or not future.cancel():
                return False
            del self._entries[key]
            self._pending.pop(key, None)
            return True

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def digests(self) -> list[CacheKey]:
        """Cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class BatchMasker:
    """Fills the bitmask rows of a batch's constrained sequences in parallel (llguidance's executor)."""

    def __init__(self, vocab_size: int, threads: int = 2) -> None:
        self.words = mask_words(vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def fill(self, states: Sequence[GrammarState | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bitmask [m, words], batch rows [m]) for the m non-None states, or None when none is
        constrained."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        mask = torch.empty((len(rows), self.words), dtype=torch.int32)
        pairs = [(states[r]._matcher, i) for i, r in enumerate(rows)]  # type: ignore[union-attr]
        self._executor.unsafe_compute_mask_ptr(pairs, mask.data_ptr(), self.words * 4, len(rows))
        return mask, torch.tensor(rows, dtype=torch.int64)


_BIAS_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each mask byte, 0 where its bit is set and -inf where it is clear."""
    table = _BIAS_TABLES.get((device, dtype))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)
        _BIAS_TABLES[(device, dtype)] = table
    return table


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set logits to -inf where the bitmask forbids, in place: row i of `bitmask` masks logits row
    `rows[i]` (or row i when `rows` is None). One byte-table lookup per 8 tokens, on the logits' device."""
    if sys.byteorder != "little":
        raise RuntimeError("bitmask byte layout assumes a little-endian host")
    vocab = logits.shape[-1]
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask must be int32 [rows, >= {mask_words(vocab)}]")
    mask = bitmask.to(logits.device, non_blocking=True).contiguous()
    table = _bias_table(logits.device, logits.dtype)
    byte_ids = mask.view(torch.uint8).reshape(-1).long()
    bias = torch.index_select(table, 0, byte_ids).view(mask.shape[0], -1)[:, :vocab]
    if rows is None:
        logits.add_(bias)
    else:
        logits.index_add_(0, rows.to(logits.device), bias)
