"""Iteration-level scheduler: which sequences run in the next step, and how many tokens each.

Decodes first, then prefill chunks within a token budget; pages come from eviction, then preemption.
With the radix cache, admission reuses a cached prefix and finished or preempted sequences feed it.
Within a priority class, VTC fair share (`worker.engine.scheduling.fairness`) chooses whose request is
admitted and whose is preempted.
"""
from __future__ import annotations

import bisect

from common.priorities import Priority
from worker.config import EngineConfig
from worker.engine.records.sequence import ScheduledBatch, SeqStatus, Sequence
from worker.engine.scheduling import batch_class
from worker.engine.scheduling.fairness import FairShare
from worker.engine.scheduling.restore import Restorer
from worker.engine.scheduling.speculative import DraftPlanner
from worker.engine.scheduling.waiting_order import cache_aware_index, cached_len, deadline_index, fair_head
from worker.kvcache.page_pool import PagePool, pages_for
from worker.kvcache.radix_cache import RadixCache

# fair-share preemption: the victim key's counter must be at least the waiting key's + this (tokens of
# service); the slot-share rule of FairShare.slot_victim already rules out thrash, so a just-lifted key may
# preempt at once
FAIR_PREEMPT_GAP = 0.0


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, cache: RadixCache | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache
        self.cache_aware = cache is not None and config.cache_aware_order
        self.bs = config.block_size
        self.waiting: list[Sequence] = []  # sorted by order_key
        self.running: list[Sequence] = []  # sorted by order_key
        self.fair = FairShare(config.fairness)
        self.drafts = DraftPlanner(config, pool, self.fair)
        self.preemptions = 0
        # first admissions only (resumes after preemption excluded): prompt tokens, of which served by the
        # cache
        self.admitted_prompt_tokens = 0
        self.cached_prompt_tokens = 0
        # keep a few pages free at admission so that new decodes do not preempt at once
        self.watermark = max(1, pool.num_pages // 100)
        self._alone_last = False  # the last step was a light key's prefill alone (`_light_alone`)
        self.restorer: Restorer | None = None  # KV tiers below the cache (set by the engine)

    def add(self, seq: Sequence) -> None:
        """A new request: its key becomes active (a requeue after preemption uses `_enqueue`)."""
        self.fair.on_active(seq.fkey, seq.weight)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.order_key)

    def remove(self, seq: Sequence) -> None:
        """Take a waiting or running sequence out (abort) and free its pages."""
        if seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        if seq.status != SeqStatus.FINISHED:
            self.fair.on_idle(seq.fkey)
        self._release_pages(seq, keep=False)
        seq.status = SeqStatus.FINISHED

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.fair.on_idle(seq.fkey)
        self._release_pages(seq, keep=True)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prefill_backlog(self) -> int:
        """Prompt tokens of waiting and prefilling requests not computed yet (cache hits still counted)."""
        return sum(s.remaining_prefill for s in self.waiting) + \
            sum(s.remaining_prefill for s in self.running if not s.in_decode)

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        batch_class.preempt_for_interactive(self, out)
        self._fair_preempt(out)
        if not self._light_alone(out):
            budget = self._schedule_decodes(out, self.config.max_num_batched_tokens)
            budget = min(budget, self._shared_step_cap())
            budget = self._admit_light(out, budget)
            budget = self.drafts.plan(out, budget)
            budget = self._schedule_running_prefills(out, budget)
            self._admit(out, budget)
        charge = self.fair.charge
        for seq in out.decodes:
            charge(seq.fkey, decode=1)
        for seq, _ in out.verifies:
            charge(seq.fkey, decode=1)  # accepted drafts are charged by `spec_accepted`
        for seq, n in out.prefills:
            charge(seq.fkey, prefill_computed=n)  # chunks never cover cached prefix tokens
        return out

    def _schedule_decodes(self, out: ScheduledBatch, budget: int) -> int:
        """Every running decode gets a token, but batch-class ones sit out a step that carries an
        interactive prefill (a first token waits for no batch work)."""
        i = 0
        pause_batch = batch_class.interactive_prefill_due(self.waiting, self.running)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not seq.in_decode or (pause_batch and seq.priority == Priority.BATCH):
                i += 1
                continue
            if not self._ensure_decode_page(seq, i, out):
                continue  # seq itself was the victim: the next sequence moved into slot i
            out.decodes.append(seq)
            budget -= 1
            i += 1
        return budget

    def _ensure_decode_page(self, seq: Sequence, i: int, out: ScheduledBatch) -> bool:
        """Make room for the K/V of seq (= running[i]), preempting from running[i:] if needed."""
        if seq.num_computed < len(seq.pages) * self.bs:
            return True
        while not self._free_a_page():
            victim = self._victim(i)
            self.preempt(victim, out)
            if victim is seq:
                return False
        seq.pages.extend(self.pool.allocate(1))
        return True

    def _victim(self, i: int) -> Sequence:
        """Newest sequence, of the lowest priority class in running[i:], of the key most over its share.

        Sequences before i are already in this step's decodes. FIFO (or one key): the newest, running[-1].
        """
        running = self.running
        last = running[-1]
        if not self.fair.fair or self.fair.active_keys < 2:
            return last
        tail = [s for s in running[i:] if s.priority == last.priority]
        key = self.fair.preemption_victim({s.fkey for s in tail})
        return next(s for s in reversed(tail) if s.fkey == key)

    def _schedule_running_prefills(self, out: ScheduledBatch, budget: int) -> int:
        admitted = {id(seq) for seq, _ in out.prefills}  # by _admit_light this step
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.in_decode and seq.remaining_prefill > 0 and id(seq) not in admitted:
                chunk = min(seq.remaining_prefill, budget)
                out.prefills.append((seq, chunk))
                budget -= chunk
        return budget

    def _admit(self, out: ScheduledBatch, budget: int, light: bool = False, under_share: bool = False) -> int:
        """Admit waiting requests (fairest key first) while slots, budget and pages last; the budget left.

        `light`: only while the chosen request's key has no running sequence; `under_share`: only while it
        runs fewer than its share of the slots.
        """
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            head = fair_head(self.waiting, self.fair)
            idx = deadline_index(self.waiting, head, self.fair)
            if idx is None and self.cache_aware:
                idx = cache_aware_index(self.waiting, head, self.fair, self.cache)
            idx = head if idx is None else idx
            seq = self.waiting[idx]
            if light and any(s.fkey == seq.fkey for s in self.running):
                break
            if under_share and not self.fair.under_share(
                    seq.fkey, sum(s.fkey == seq.fkey for s in self.running), self.config.max_num_seqs):
                break
            if self._step_prefill_full(out, seq):
                break
            if self._prefix_in_flight(seq) or not self._reserve(seq):
                break  # the chosen request waits; others do not jump it
            self.waiting.pop(idx)
            if idx != head:
                self.waiting[head].skipped += 1
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.order_key)
            chunk = min(seq.remaining_prefill, budget)
            out.prefills.append((seq, chunk))
            budget -= chunk
        return budget

    def _step_prefill_full(self, out: ScheduledBatch, seq: Sequence) -> bool:
        """`prefill_step_tokens`: whether this step, already carrying a prefill, has no room for seq's
        uncached tokens (the first prefill of a step is never held)."""
        cap = self.config.prefill_step_tokens
        if not cap or not out.prefills:
            return False
        cached = cached_len(self.cache, seq) if self.cache is not None else 0
        return sum(n for _, n in out.prefills) + len(seq.tokens) - cached > cap

    # ---- fair share of slots (VTC with several active keys; no-ops otherwise) ----

    def _fair_preempt(self, out: ScheduledBatch) -> None:
        """No slot free and the fairest waiting request's key runs fewer than its share of `max_num_seqs`:
        preempt the newest sequence (of the waiting one's priority class or lower) of the key most over its
        share (`FairShare.slot_victim`). One per step; its pages go to the radix cache, so resuming is cheap.
        """
        fair, running = self.fair, self.running
        if (not self.waiting or not fair.fair or fair.active_keys < 2
                or len(running) < self.config.max_num_seqs):
            return
        head = self.waiting[fair_head(self.waiting, self.fair)]
        key = fair.slot_victim(head.fkey, self._running_per_key(), self.config.max_num_seqs, FAIR_PREEMPT_GAP)
        if key is None:
            return
        victim = next((s for s in reversed(running) if s.fkey == key and s.priority >= head.priority), None)
        if victim is not None:
            self.preempt(victim, out)

    def _running_per_key(self) -> dict[bytes, int]:
        counts: dict[bytes, int] = {}
        for s in self.running:
            counts[s.fkey] = counts.get(s.fkey, 0) + 1
        return counts

    def _shared_step_cap(self) -> int:
        """Prefill tokens this step may carry: `fair_step_tokens` while the worker is shared (VTC tracks more
        than one key, idle ones included), so a light key's request never waits behind a long step."""
        cap = self.config.fair_step_tokens
        return cap if cap and self.fair.fair and len(self.fair) > 1 else self.config.max_num_batched_tokens

    def _admit_light(self, out: ScheduledBatch, budget: int) -> int:
        """Before running prefill chunks: admit the fairest waiting requests of keys with nothing running
        (light keys); the budget left. A step that admits one carries no other prefill chunk (budget 0), so
        on a compute-bound device a light key's first token is not held behind others' prefills.
        """
        if not self.waiting or not self.fair.fair or self.fair.active_keys < 2:
            return budget
        n = len(out.prefills)
        budget = self._admit(out, budget, light=True)
        return 0 if len(out.prefills) > n else budget

    def _light_alone(self, out: ScheduledBatch) -> bool:
        """While a key runs more than its share of the slots (a flood), the requests of keys under their share
        prefill in a step of their own, so a first token waits only for the step in flight, not also for the
        flood's decodes. Never two such steps in a row: the others' decodes run at least every other step."""
        alone, self._alone_last = self._alone_last, False
        fair = self.fair
        if alone or not self.waiting or not fair.fair or fair.active_keys < 2 or not self.running:
            return False
        slots = self.config.max_num_seqs
        if not any(fair.over_share(key, n, slots) for key, n in self._running_per_key().items()):
            return False
        n = len(out.prefills)
        self._admit(out, self.config.max_num_batched_tokens, under_share=True)
        self._alone_last = len(out.prefills) > n
        return self._alone_last

    def _reserve(self, seq: Sequence) -> bool:
        """Give seq its block table (cached prefix + new pages for the rest) or, if memory is short,
        nothing."""
        self._match_prefix(seq)
        pages = self.take_pages(pages_for(len(seq.tokens), self.bs) - len(seq.pages))
        if pages is None:
            self._release_pages(seq, keep=False)  # undo the match: its pages stay cached
            seq.num_computed = 0
            return False
        seq.pages.extend(pages)
        if seq.admissions == 0:
            seq.cached_tokens = seq.num_computed
            self.admitted_prompt_tokens += seq.prompt_len
            self.cached_prompt_tokens += seq.num_computed
        seq.admissions += 1
        return True

    def take_pages(self, need: int) -> list[int] | None:
        """`need` fresh pages, keeping the watermark free for the running requests (evicting cached pages if
        that is what it takes); None when they do not fit. Admission's rule, also for a disaggregated
        prefill's lease."""
        if not self._make_room(need, need + (self.watermark if self.running else 0)):
            return None
        return self.pool.allocate(need)

    def _make_room(self, need: int, reserve: int) -> bool:
        """True when `need` pages are free now and `reserve` are free or evictable (evicts the shortfall)."""
        free = self.pool.num_free
        if free >= reserve:
            return True
        cache = self.cache
        if cache is None or free + cache.evictable_pages < reserve:
            return False
        if free < need:
            cache.evict(need - free)
        return self.pool.num_free >= need

    def _free_a_page(self) -> bool:
        """True when a page is free, evicting one unlocked cached page if that is what it takes."""
        if self.pool.num_free > 0:
            return True
        return self.cache is not None and self.cache.evict(1) > 0 and self.pool.num_free > 0

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """True when a running sequence is prefilling the next page seq would otherwise compute itself."""
        if self.cache is None or len(seq.tokens) <= self.bs:
            return False
        lo = cached_len(self.cache, seq)
        hi = lo + self.bs
        if hi >= len(seq.tokens):
            return False  # no further full page to gain (the last token is always computed)
        page = seq.tokens[lo:hi]
        for other in self.running:
            if other.in_decode or other.namespace != seq.namespace or len(other.tokens) < hi:
                continue
            if other.tokens[lo:hi] == page and other.tokens[:lo] == seq.tokens[:lo]:
                return True
        return False

    def publish(self, seq: Sequence) -> None:
        """After seq's prefill completed: share its full pages through the cache while it keeps running.

        The tree takes seq's pages (or keeps its own copies of the same tokens, releasing seq's
        duplicates); seq then holds the tree's pages under a fresh lock, so it reads the same KV.
        """
        cache = self.cache
        n_full = seq.num_computed // self.bs
        if cache is None or n_full == 0:
            return
        toks = seq.tokens[:n_full * self.bs]
        cache.insert(seq.namespace, toks, seq.pages)
        m = cache.match_prefix(seq.namespace, toks)
        assert m.num_tokens == len(toks), "a just-inserted prefix must match in full"
        seq.pages[:n_full] = m.pages
        if seq.prefix_handle is not None:
            cache.unlock(seq.prefix_handle)
        seq.prefix_handle = m.handle

    def preempt(self, seq: Sequence, out: ScheduledBatch) -> None:
        self.running.remove(seq)
        self._release_pages(seq, keep=True)
        seq.num_computed = 0
        self.preemptions += 1
        out.preempted.append(seq)
        self._enqueue(seq)

    def spec_accepted(self, seq: Sequence, accepted: int) -> None:
        """After verification: charge the accepted drafts and roll back the pages of the rejected ones."""
        self.drafts.accepted(seq, accepted)

    # ---- radix prefix cache call sites ----

    def _match_prefix(self, seq: Sequence) -> None:
        """Admission: start seq's block table with the pages of its longest cached prefix (locked).

        Matches `tokens[:-1]` so that at least the last token is computed and yields logits.
        """
        if self.cache is None or len(seq.tokens) < 2:
            return
        if self.restorer is not None:
            self.restorer.restore(seq)  # tier-held blocks past the cached prefix join the cache first
        m = self.cache.match_prefix(seq.namespace, seq.tokens[:-1])
        if m.handle is not None:
            seq.pages = m.pages
            seq.prefix_handle = m.handle
            seq.num_computed = m.num_tokens

    def _release_pages(self, seq: Sequence, keep: bool) -> None:
        """Finish/preempt (keep=True): cache seq's computed full pages; then drop its references and lock."""
        pages = seq.pages
        cache = self.cache
        if cache is not None and keep and seq.num_computed >= self.bs:
            cache.insert(seq.namespace, seq.tokens[:seq.num_computed], pages)  # takes our refs to full pages
            pages = pages[seq.num_computed // self.bs:]
        if pages:
            self.pool.release(pages)
        seq.pages = []
        if seq.prefix_handle is not None:
            assert cache is not None
            cache.unlock(seq.prefix_handle)
            seq.prefix_handle = None
