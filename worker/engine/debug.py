"""Engine and runner subclasses for tests and benchmarks (every computed logit row, step shapes), and the
page leak check.

The production classes carry no such hooks; these override their seams (`Engine.runner_class`,
`ModelRunner.prepare` / `logits`) and cost nothing unless used.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from worker.engine.core import Engine, StepOutput
from worker.engine.records.sequence import ScheduledBatch, Sequence
from worker.engine.runner import ModelRunner
from worker.model.llama import StepContext

__all__ = ["DebugEngine", "DebugRunner", "pages_idle"]


class DebugRunner(ModelRunner):
    """Records the latest step's (tokens, logit rows) and, with `all_logits`, every row's logits."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.all_logits = False
        self.last_step_shape: tuple[int, int] = (0, 0)
        self.segments: list[tuple[Sequence, int, torch.Tensor]] = []  # (sequence, first position, [n, vocab])
        self._spans: list[tuple[Sequence, int, int]] = []

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, StepContext, list[Sequence]]:
        input_ids, ctx, sampled = super().prepare(batch)
        self.last_step_shape = (input_ids.numel(), ctx.logits_rows.numel())
        self._spans = [(seq, seq.num_computed, 1) for seq in batch.decodes]
        self._spans += [(seq, seq.num_computed, 1 + len(d)) for seq, d in batch.verifies]
        self._spans += [(seq, seq.num_computed, n) for seq, n in batch.prefills]
        return input_ids, ctx, sampled

    def logits(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        if not self.all_logits:
            return super().logits(input_ids, ctx)
        every = torch.arange(input_ids.shape[0], device=input_ids.device)
        full = self.model(input_ids, replace(ctx, logits_rows=every))
        row = 0
        for seq, pos, n in self._spans:
            self.segments.append((seq, pos, full[row:row + n]))
            row += n
        return full[ctx.logits_rows]


class DebugEngine(Engine):
    """An `Engine` whose `step(capture=)` receives (rid, first position, logits) for every row computed."""

    runner_class = DebugRunner

    def step(self, capture: list | None = None) -> list[StepOutput]:
        runner = self.runner
        runner.all_logits = capture is not None
        runner.segments = []
        outputs = super().step()
        if capture is not None:
            capture.extend((seq.rid, pos, lg) for seq, pos, lg in runner.segments)
        return outputs


def pages_idle(engine: Engine) -> bool:
    """Leak check (tests): no request holds a page; each page is free or held once, unlocked, by the cache."""
    pool, cache = engine.pool, engine.cache
    cached = {p for pages in cache.snapshot().values() for p in pages.values()} if cache else set()
    if cache is not None and cache.locked_pages:
        return False
    if pool.num_free + len(cached) != pool.num_pages:
        return False
    return all(pool.refcount(p) == (1 if p in cached else 0) for p in range(pool.num_pages))
