"""One request's state inside the engine: its tokens (prompt, then output), how many of them the
KV cache holds, its pages and its place in the queue. Survives preemption by recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from worker.protocol import Priority, SamplingParams

if TYPE_CHECKING:
    from worker.grammar import GrammarState
    from worker.radix_cache import RadixNode
    from worker.speculative import NgramIndex


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
    ngram: NgramIndex | None = None  # draft source for speculative decoding; None when the request cannot use it

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
