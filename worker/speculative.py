"""Prompt-lookup (n-gram) drafts for speculative decoding: no draft model, only the request's own tokens.

The runner verifies drafts in one forward and the engine keeps the longest agreeing prefix (see docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.config import EngineConfig
from worker.fairness import FairShare
from worker.page_pool import PagePool
from worker.protocol import SamplingParams

if TYPE_CHECKING:
    from worker.scheduler import ScheduledBatch
    from worker.sequence import Sequence

MAX_BACKOFF = 16  # steps a sequence waits, at most, after drafts that were all rejected
_SHIFT = 21  # bits per token in an n-gram key: exact for ids < 2^21 - 1 and n <= 3 (else rare, harmless collisions)


def speculation_allowed(p: SamplingParams) -> bool:
    """Requests whose sampling the verifier reproduces exactly: no grammar, penalties, bias or logprobs.

    `min_tokens` is checked per step (drafts start once the ban is over)."""
    return (p.speculative and p.grammar is None and not p.penalized and not p.logit_bias
            and not p.logprobs and not p.top_logprobs)


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
        """After a verification: back off while drafts keep failing (free text), resume at once after a hit."""
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


def _pages_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class DraftPlanner:
    """The scheduler's speculative part: which decodes verify drafts this step, and the rollback after."""

    def __init__(self, config: EngineConfig, pool: PagePool, fair: FairShare) -> None:
        self.config = config
        self.pool = pool
        self.fair = fair
        self.bs = config.block_size

    def plan(self, out: ScheduledBatch, budget: int) -> int:
        """At low load, turn decodes that have n-gram drafts into verify chunks (1 + drafts tokens each).

        Draft tokens take budget and only free pages (never evictions or preemptions); the budget left."""
        k_max = self.config.spec_tokens
        if not k_max or not out.decodes or len(out.decodes) > self.config.spec_max_batch:
            return budget
        kept: list[Sequence] = []
        for seq in out.decodes:
            drafts = self._drafts(seq, min(k_max, budget)) if budget > 0 and seq.ngram is not None else None
            if drafts:
                out.verifies.append((seq, drafts))
                budget -= len(drafts)
            else:
                kept.append(seq)
        out.decodes = kept
        return budget

    def _drafts(self, seq: Sequence, k: int) -> list[int] | None:
        """Up to k proposals for seq, with pages for their K/V; None when it should decode plainly."""
        p = seq.sampling
        k = min(k, p.max_tokens - seq.num_output - 1)  # the step emits at most drafts + 1 tokens
        if k <= 0 or seq.num_output < p.min_tokens:
            return None
        room = (len(seq.pages) + self.pool.num_free) * self.bs - seq.num_computed - 1
        drafts = seq.ngram.propose(seq.tokens, min(k, room)) if room > 0 else None
        if not drafts:
            return None
        extra = _pages_for(seq.num_computed + 1 + len(drafts), self.bs) - len(seq.pages)
        if extra > 0:
            seq.pages.extend(self.pool.allocate(extra))
        return drafts

    def accepted(self, seq: Sequence, accepted: int) -> None:
        """After verification: charge the accepted drafts; drop pages past the accepted K/V (rolled back)."""
        seq.ngram.record(accepted)
        if accepted:
            self.fair.charge(seq.fkey, decode=accepted)
        keep = _pages_for(seq.num_computed, self.bs)
        if len(seq.pages) > keep:
            self.pool.release(seq.pages[keep:])
            del seq.pages[keep:]
