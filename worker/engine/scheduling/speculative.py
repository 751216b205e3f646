"""Prompt-lookup (n-gram) drafts for speculative decoding: no draft model, only the request's own tokens.

The runner verifies drafts in one forward and the engine keeps the longest agreeing prefix (see
docs/architecture.md).
"""

from __future__ import annotations

from worker.config import EngineConfig
from worker.engine.records.sequence import ScheduledBatch, Sequence
from worker.engine.scheduling.fairness import FairShare
from worker.kvcache.page_pool import PagePool, pages_for
from worker.protocol import SamplingParams


def speculation_allowed(p: SamplingParams) -> bool:
    """Requests whose sampling the verifier reproduces exactly: no grammar, penalties, bias or logprobs.

    `min_tokens` is checked per step (drafts start once the ban is over)."""
    return (p.speculative and p.grammar is None and not p.penalized and not p.logit_bias
            and not p.logprobs and not p.top_logprobs)


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
        extra = pages_for(seq.num_computed + 1 + len(drafts), self.bs) - len(seq.pages)
        if extra > 0:
            seq.pages.extend(self.pool.allocate(extra))
        return drafts

    def accepted(self, seq: Sequence, accepted: int) -> None:
        """After verification: charge the accepted drafts; drop pages past the accepted K/V (rolled back)."""
        seq.ngram.record(accepted)
        if accepted:
            self.fair.charge(seq.fkey, decode=accepted)
        keep = pages_for(seq.num_computed, self.bs)
        if len(seq.pages) > keep:
            self.pool.release(seq.pages[keep:])
            del seq.pages[keep:]
