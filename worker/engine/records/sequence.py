"""The engine's records: one request's state (its tokens, how many of them the KV cache holds, its pages, its
place in the queue; survives preemption by recomputing), its n-gram draft index, and one step's scheduled
batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from common.priorities import Priority
from worker.protocol import SamplingParams

if TYPE_CHECKING:
    from worker.kvcache.radix_cache import RadixNode
    from worker.sample.grammar import GrammarState

MAX_BACKOFF = 16  # steps a sequence waits, at most, after drafts that were all rejected
# bits per token in an n-gram key: exact for ids < 2^21 - 1 and n <= 3 (else rare, harmless collisions)
_SHIFT = 21


class SeqStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True)
class Sequence:
    rid: str
    tokens: list[int]  # the prompt, then every generated token
    prompt_len: int
    sampling: SamplingParams
    priority: Priority
    arrival: int  # engine-wide counter: FIFO order within a priority class
    namespace: bytes
    seed: int  # 32-bit; drawn at random when the request gave none
    stop_ids: frozenset[int]
    fkey: bytes = b""  # fairness key (opaque tenant digest); the scheduler's fair share is per key
    weight: float = 1.0  # the key's relative share
    ttft_deadline: float = 0.0  # unix seconds its first token is due by; 0.0: no TTFT target
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are cached; 0 again after a preemption
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admissions: int = 0  # times admitted (> 1 after preemptions)
    prefix_handle: RadixNode | None = None  # lock of the prefix match while running
    # cache-aware order: memo of the cached prefix length, valid while the cache content is unchanged
    peek_sig: tuple[int, int] = (-1, -1)
    peek_tokens: int = 0
    skipped: int = 0  # admissions of later same-priority requests ahead of this one while it headed the queue
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    grammar: GrammarState | None = None  # constrained output: the matcher, advanced with every token
    # draft source for speculative decoding; None when the request cannot use it
    ngram: NgramIndex | None = None
    block_hashes: tuple[int, list[bytes]] | None = None  # KV tiers: (tokens hashed, their block digests)

    @property
    def order_key(self) -> tuple[int, int]:
        return (int(self.priority), self.arrival)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def in_decode(self) -> bool:
        return self.num_computed == len(self.tokens) - 1

    @property
    def remaining_prefill(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass(slots=True)
class NgramIndex:
    """Per sequence: n-gram key -> position after its latest occurrence, for n in [n_min, n_max].

    Indexed incrementally (amortized n_max dict writes per token); bounded by n_max x the sequence's length.
    """

    n_min: int
    n_max: int
    upto: int = 0  # n-grams ending before this position are indexed
    table: dict[int, int] = field(default_factory=dict)
    misses: int = 0  # verifications in a row that accepted nothing
    skip: int = 0  # steps left without drafts (backoff: 2, 4, ... MAX_BACKOFF after 1, 2, ... misses)

    def record(self, accepted: int) -> None:
        """After a verification: back off while drafts keep failing (free text), resume at once after a
        hit."""
        if accepted:
            self.misses = self.skip = 0
        else:
            self.misses += 1
            self.skip = min(1 << self.misses, MAX_BACKOFF)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if self.skip:
            self.skip -= 1
            return []
        end = len(tokens) - 1  # index n-grams ending before `end`: each has a continuation
        table, lo, hi = self.table, self.n_min, self.n_max
        for e in range(self.upto, end):
            key = 0
            for n in range(1, min(hi, e + 1) + 1):
                key = (key << _SHIFT) | (tokens[e + 1 - n] + 1)
                if n >= lo:
                    table[key] = e + 1
        self.upto = max(self.upto, end)
        keys = []
        key = 0
        for n in range(1, min(hi, len(tokens)) + 1):
            key = (key << _SHIFT) | (tokens[len(tokens) - n] + 1)
            keys.append(key)
        for n in range(len(keys), lo - 1, -1):
            start = table.get(keys[n - 1])
            if start is not None:
                return tokens[start:start + k]
        return []


@dataclass(slots=True)
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)
    preempted: list[Sequence] = field(default_factory=list)
    verifies: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # decodes with drafts to verify

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies
