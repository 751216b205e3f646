"""Which waiting request the scheduler admits next: the fairest key's oldest request (VTC), then the
earliest TTFT deadline of that key's interactive requests, else, with the radix cache, the request of that
class and key with the longest cached prefix (cache-aware order).
"""

from __future__ import annotations

import math

from common.priorities import Priority
from worker.engine.records.sequence import Sequence
from worker.engine.scheduling.fairness import FairShare
from worker.kvcache.radix_cache import RadixCache

# cache-aware order: plain arrival order above this many waiting requests (bounds the per-step cost),
# and for a queue head that later requests with longer cached prefixes overtook this many times
CACHE_AWARE_MAX_QUEUE = 64
CACHE_AWARE_MAX_SKIPS = 32


def fair_head(waiting: list[Sequence], fair: FairShare) -> int:
    """Index of the oldest waiting request of the head's priority class whose key has the lowest counter
    (ties: the key with fewer requests in the engine, as a just-lifted light key).

    Arrival order (0) under FIFO or with one active key. O(waiting of that class).
    """
    if not fair.fair or fair.active_keys < 2:
        return 0
    prio = waiting[0].priority
    counter, active = fair.counter, fair.active_requests
    best, best_c = 0, (counter(waiting[0].fkey), active(waiting[0].fkey))
    seen = {waiting[0].fkey}
    for i in range(1, len(waiting)):
        seq = waiting[i]
        if seq.priority != prio:
            break
        if seq.fkey in seen:
            continue
        seen.add(seq.fkey)
        c = (counter(seq.fkey), active(seq.fkey))
        if c < best_c:
            best, best_c = i, c
    return best


def deadline_index(waiting: list[Sequence], start: int, fair: FairShare) -> int | None:
    """Index of the interactive request of waiting[start]'s key (under VTC with several keys; else of the
    class) with the earliest TTFT deadline; None when none has one (the caller keeps its own order).

    Requests without a deadline go after those with one; a head overtaken `CACHE_AWARE_MAX_SKIPS` times goes
    first (no starvation). O(waiting of that class).
    """
    head = waiting[start]
    if head.priority != Priority.INTERACTIVE or head.skipped >= CACHE_AWARE_MAX_SKIPS:
        return None
    by_key = fair.fair and fair.active_keys > 1
    best, best_due = None, math.inf
    for i in range(start, len(waiting)):
        seq = waiting[i]
        if seq.priority != head.priority:
            break
        if by_key and seq.fkey != head.fkey:
            continue
        if 0.0 < seq.ttft_deadline < best_due and not seq.admissions:  # a preempted one had its first
            best, best_due = i, seq.ttft_deadline
    return best


def cache_aware_index(waiting: list[Sequence], start: int, fair: FairShare, cache: RadixCache) -> int:
    """Index of the request of waiting[start]'s priority (and key, under VTC with several keys) with the
    longest cached prefix.

    Ties keep arrival order. Plain arrival order when the queue is long (bounded cost per step)
    or when the head was overtaken too often (no starvation of requests without a shared prefix).
    """
    head = waiting[start]
    if len(waiting) > CACHE_AWARE_MAX_QUEUE or head.skipped >= CACHE_AWARE_MAX_SKIPS:
        return start
    best, best_len = start, cached_len(cache, head)
    by_key = fair.fair and fair.active_keys > 1
    for i in range(start + 1, len(waiting)):
        seq = waiting[i]
        if seq.priority != head.priority:
            break
        if by_key and seq.fkey != head.fkey:
            continue
        n = cached_len(cache, seq)
        if n > best_len:
            best, best_len = i, n
    return best


def cached_len(cache: RadixCache, seq: Sequence) -> int:
    """Cached prefix length of seq (what admission would match), memoized while the tree is unchanged."""
    # cached + evicted pages grows with every insert that adds pages; evicted with every eviction
    sig = (cache.cached_pages, cache.evicted_pages)
    if seq.peek_sig != sig:
        seq.peek_sig = sig
        seq.peek_tokens = cache.peek(seq.namespace, seq.tokens[:-1]) if len(seq.tokens) > 1 else 0
    return seq.peek_tokens
