"""Batch-class work runs only in the room interactive work leaves: the scheduler's two rules for it."""

from __future__ import annotations

from typing import Protocol

from common.priorities import Priority
from worker.config import EngineConfig
from worker.engine.records.sequence import ScheduledBatch, Sequence
from worker.engine.scheduling.waiting_order import cached_len
from worker.kvcache.page_pool import PagePool, pages_for
from worker.kvcache.radix_cache import RadixCache


class Scheduler(Protocol):
    """What these rules use of `worker.engine.scheduling.scheduler.Scheduler`."""

    config: EngineConfig
    pool: PagePool
    cache: RadixCache | None
    bs: int
    watermark: int
    waiting: list[Sequence]
    running: list[Sequence]

    def preempt(self, seq: Sequence, out: ScheduledBatch) -> None: ...

PREEMPT_MAX = 8  # batch-class sequences preempted for one waiting interactive request in one step


def preempt_for_interactive(sched: Scheduler, out: ScheduledBatch) -> None:
    """While the first waiting request is interactive and finds no slot or no pages, preempt the newest
    batch-class sequences (their pages go to the radix cache, and below it to the KV tiers; they resume from
    there once room is back)."""
    if not sched.waiting or sched.waiting[0].priority != Priority.INTERACTIVE:
        return
    head = sched.waiting[0]
    for _ in range(PREEMPT_MAX):
        victim = sched.running[-1] if sched.running else None  # running is sorted: batch last
        if victim is None or victim.priority != Priority.BATCH or _fits(sched, head):
            return
        sched.preempt(victim, out)


def interactive_prefill_due(waiting: list[Sequence], running: list[Sequence]) -> bool:
    """An interactive request waits or is mid-prefill while batch-class work runs: that step's batch decodes
    sit out (a first token waits for no batch work)."""
    if not running or running[-1].priority != Priority.BATCH:
        return False
    if waiting and waiting[0].priority == Priority.INTERACTIVE:
        return True
    return any(not s.in_decode for s in running if s.priority == Priority.INTERACTIVE)


def _fits(sched: Scheduler, seq: Sequence) -> bool:
    """A slot is free and seq's uncached pages are free or evictable, above the watermark."""
    if len(sched.running) >= sched.config.max_num_seqs:
        return False
    cache = sched.cache
    cached = cached_len(cache, seq) // sched.bs if cache is not None else 0
    need = pages_for(len(seq.tokens), sched.bs) - cached + sched.watermark
    return sched.pool.num_free + (cache.evictable_pages if cache is not None else 0) >= need
