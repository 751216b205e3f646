"""One request's state inside the engine.

`tokens` holds the prompt followed by every generated token; `num_computed`
counts the leading tokens whose K/V are in the cache. A decode step feeds the
last token (`num_computed == len(tokens) - 1`); a prefill chunk feeds the next
slice. After a preemption `num_computed` drops to 0 and `tokens` is
recomputed (mostly served by the prefix cache, which keeps the preempted
sequence's pages), so outputs survive preemption unchanged. With the prefix
cache, admission starts `pages` with the matched shared pages and
`num_computed` at the matched length; `prefix_handle` is that match's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from worker.sampling import SamplingParams

if TYPE_CHECKING:
    from worker.radix_cache import RadixNode


class Priority(IntEnum):
    INTERACTIVE = 0
    BATCH = 1


class SeqStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True)
class Sequence:
    rid: str
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    priority: Priority
    arrival: int  # engine-wide counter: FIFO order within a priority class
    namespace: bytes
    seed: int  # 32-bit; drawn at random when the request gave none
    stop_ids: frozenset[int]
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admissions: int = 0  # times admitted (> 1 after preemptions)
    prefix_handle: RadixNode | None = None  # lock of the prefix match while running
    # cache-aware order: memo of the cached prefix length, valid while the cache content is unchanged
    peek_sig: tuple[int, int] = (-1, -1)
    peek_tokens: int = 0
    skipped: int = 0  # admissions of later same-priority requests ahead of this one while it headed the queue
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None

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
