"""Capacity admission: admit a request when some live worker has room for its KV tokens, else queue or
shed it.

Pure asyncio over a callable of per-worker views (`WorkerCapacity`); `notify()` on new stats, `release()`
on ends.
Waiters are served fairly across tenants within a priority class (`admission.fair_waiters`). A request with a
TTFT target is shed at once when its predicted time to first token exceeds it (`admission.ttft_predict`), and
waits no longer than its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from admission.fair_waiters import FairWaiters, Waiter
from admission.ttft_predict import TtftTarget, WorkerLoad, excess_retry_s, predict_ttft_s, quickest_service_s
from common.priorities import Priority

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH
DRAIN_WINDOW_S = 30.0
DRAIN_BIN_S = 1.0  # releases are summed per bin, so the history holds at most window / bin entries
IDLE_RESET_S = 1.0


@dataclass(slots=True, frozen=True)
class WorkerCapacity:
    """One worker's capacity as last reported (tokens of KV cache)."""

    worker_id: str
    kv_free: int
    kv_total: int
    queued_tokens: int = 0
    draining: bool = False
    updated_at: float = 0.0  # clock() time of the stats sample; 0: unknown (all pending tickets count)
    prefill_tps: float = 0.0  # measured prompt tokens a second (0.0: unknown)
    step_s: float = 0.0  # measured seconds of one engine step (0.0: unknown)
    prefill_backlog: int = 0  # prompt tokens queued or mid-prefill on the worker


class Overloaded(Exception):
    """No capacity within the wait budget: 503 server_overloaded with `retry-after`."""

    def __init__(self, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TtftUnattainable(Overloaded):
    """The request's TTFT target cannot be met: 503 ttft_slo_unattainable with `retry-after`."""

    def __init__(self, retry_after_s: float, message: str, priority: Priority) -> None:
        super().__init__(retry_after_s, message)
        self.priority = priority


class CapacityNeverFits(ValueError):
    """The request needs more KV tokens than any worker has in total."""


@dataclass(slots=True, eq=False)
class CapacityTicket:
    """An admitted request's claim on capacity; give it back with `CapacityGate.release`."""

    cost: int
    priority: Priority
    worker_id: str       # the worker whose headroom admitted it (a routing hint, not a binding)
    admitted_at: float
    released: bool = False
    key: str = ""        # the tenant's fairness key in this gate
    prefill: int = 0     # prompt tokens the worker computes before the first token


class CapacityGate:
    """Admit, queue (bounded wait, interactive first, fair across keys) or shed requests by KV-token cost.

    `fair_queue=False`: one FIFO per priority class, whatever the key.
    """

    def __init__(self, views: Callable[[], Iterable[WorkerCapacity]], *, admission_wait_ms: int = 2000,
                 interactive_reserve: float = 0.2, min_retry_s: float = 1.0, max_retry_s: float = 30.0,
                 fallback_retry_s: float = 5.0, max_queue: int = 1024, fair_queue: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= interactive_reserve < 1.0:
            raise ValueError("interactive_reserve must be in [0, 1)")
        self._views = views
        self.admission_wait_s = admission_wait_ms / 1000
        self.interactive_reserve = interactive_reserve
        self.min_retry_s, self.max_retry_s, self.fallback_retry_s = min_retry_s, max_retry_s, fallback_retry_s
        self.max_queue = max_queue
        self._clock = clock
        self._waiters = FairWaiters(fair=fair_queue)
        self._pending: dict[str, list[CapacityTicket]] = {}
        self._drained: deque[list[float]] = deque()  # [bin start, tokens released in the bin], oldest first
        self._drained_sum = 0
        self._outstanding = 0  # tickets admitted and not yet released
        self._idle_since: float | None = None  # when _outstanding last dropped to 0
        self.shed: dict[Priority, int] = {INTERACTIVE: 0, BATCH: 0}
        self.slo_shed: dict[Priority, int] = {INTERACTIVE: 0, BATCH: 0}  # TTFT targets found unattainable

    # ---- public API -------------------------------------------------------------------------------
    async def acquire(self, cost: int, priority: Priority, key: str = "", weight: float = 1.0, *,
                      prefill: int = 0, slo: TtftTarget | None = None) -> CapacityTicket:
        """Admit now, or wait up to `admission_wait_ms`; raises Overloaded or CapacityNeverFits.

        `key`/`weight`: the tenant and its share among the waiters of its priority class. `prefill`: its
        prompt tokens to compute; `slo`: its TTFT target (TtftUnattainable when predicted missed, or when
        its deadline passes while it waits).
        """
        if priority not in (INTERACTIVE, BATCH):
            raise ValueError(f"priority must be a Priority, got {priority!r}")
        if cost < 0:
            raise ValueError("cost must be >= 0")
        self._waiters.activate(key, weight)
        try:
            return await self._acquire(cost, Priority(priority), key, max(0, prefill), slo)
        except BaseException:
            self._waiters.deactivate(key)
            raise

    async def _acquire(self, cost: int, priority: Priority, key: str, prefill: int,
                       slo: TtftTarget | None) -> CapacityTicket:
        views = self._live_views()
        if views and cost > max(v.kv_total for v in views):
            raise CapacityNeverFits(f"request needs {cost} KV tokens; the largest worker holds "
                                    f"{max(v.kv_total for v in views)}")
        if slo is not None:
            self._check_slo(cost, prefill, priority, views, slo)
        if not self._blocked(priority):
            ticket = self._try_admit(cost, priority, views, key, prefill)
            if ticket is not None:
                return ticket
        waiters = self._waiters
        if waiters.count(priority) >= self.max_queue:
            pushed = waiters.push_out(priority, key)
            if pushed is None:
                raise self._overloaded(cost, priority, "admission queue full")
            pushed.future.set_exception(self._overloaded(pushed.cost, priority, "admission queue full"))
        waiter = waiters.new_waiter(cost, priority, key, prefill)
        waiters.push(waiter)
        if waiters.fair:
            self.notify()  # the newcomer may be the fairest head
        # with a target, it waits only while admission could still meet it: until its deadline less the
        # service time a worker would then take (admitted later, its first token would come too late)
        wait_s = self.admission_wait_s if slo is None else min(self.admission_wait_s, max(
            0.0, slo.deadline - self._clock() - self.service_s(prefill, priority, views)))
        try:
            await asyncio.wait({waiter.future}, timeout=wait_s)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if waiter.future.done():
            return waiter.future.result()  # a ticket, or Overloaded when pushed out of a full queue
        self._abandon(waiter)
        # the wait is charged like an admission: a key shed after holding the queue's head does not keep the
        # lowest counter, so it cannot hold the head again and again at no cost
        self._waiters.charge(key, cost)
        if slo is not None and wait_s < self.admission_wait_s:  # its deadline passed while it waited
            raise self._unattainable(slo, priority, self.retry_after_s(cost, priority),
                                     "admitted any later, it would miss it")
        raise self._overloaded(cost, priority, f"no capacity within {self.admission_wait_s * 1000:.0f} ms")

    def release(self, ticket: CapacityTicket) -> None:
        """The request ended: forget its cost, count it as drained capacity and wake waiters."""
        if ticket.released:
            return
        self._waiters.deactivate(ticket.key)
        self._give_back(ticket)

    def _give_back(self, ticket: CapacityTicket) -> None:
        ticket.released = True
        self._outstanding -= 1
        if self._outstanding == 0:
            self._idle_since = self._clock()
        tickets = self._pending.get(ticket.worker_id)
        if tickets is not None:
            with contextlib.suppress(ValueError):
                tickets.remove(ticket)
        self._record_drain(ticket.cost)
        self.notify()

    def notify(self) -> None:
        """Capacity may have changed (new worker stats, a release): admit waiters that now fit."""
        views = None
        waiters = self._waiters
        for priority in (INTERACTIVE, BATCH):
            while (waiter := waiters.head(priority)) is not None:
                if waiter.future.done():
                    waiters.remove(waiter)
                    continue
                if priority == BATCH and waiters.count(INTERACTIVE):
                    return
                views = views if views is not None else self._live_views()
                ticket = self._try_admit(waiter.cost, priority, views, waiter.key, waiter.prefill)
                if ticket is None:
                    break  # the chosen head waits; the others do not jump it
                waiters.remove(waiter)
                waiter.future.set_result(ticket)

    @contextlib.asynccontextmanager
    async def admit(self, cost: int, priority: Priority, key: str = "",
                    weight: float = 1.0) -> AsyncIterator[CapacityTicket]:
        ticket = await self.acquire(cost, priority, key, weight)
        try:
            yield ticket
        finally:
            self.release(ticket)

    @property
    def waiting(self) -> dict[Priority, int]:
        return {p: self._waiters.count(p) for p in (INTERACTIVE, BATCH)}

    def retry_after_s(self, cost: int, priority: Priority) -> float:
        """Seconds until the deficit for this request (and those queued ahead) should have drained."""
        deficit = self._deficit(cost, priority, self._live_views())
        rate = self.drain_rate()
        seconds = deficit / rate if rate > 0 else self.fallback_retry_s
        return float(min(self.max_retry_s, max(self.min_retry_s, math.ceil(seconds * 10) / 10)))

    def predict_ttft_s(self, cost: int, prefill: int, priority: Priority,
                       views: list[WorkerCapacity] | None = None) -> float:
        """Predicted seconds to this request's first token: the wait for KV capacity (none when it fits now,
        the deficit at the drain rate, or `fallback_retry_s` when nothing drained yet), then the prompts
        queued ahead of it and its own at the workers' measured prefill rates, then one step."""
        views = self._live_views() if views is None else views
        fits = [self._headroom(v, priority) >= cost for v in views]
        deficit = self._deficit(cost, priority, views)
        rate = self.drain_rate()
        if any(fits) and not self._blocked(priority) or deficit == 0:
            wait = 0.0
        else:
            wait = deficit / rate if rate > 0 else self.fallback_retry_s
        return predict_ttft_s(self._loads(views, fits), prefill, self._ahead(priority, prefill=True), wait)

    def service_s(self, prefill: int, priority: Priority, views: list[WorkerCapacity]) -> float:
        """Seconds from admission to the first token on the quickest worker with room (any, when none has):
        its backlog and this prompt at its prefill rate, then a step."""
        if not views:
            return 0.0
        with_room = [self._headroom(v, priority) > 0 for v in views]
        return quickest_service_s(self._loads(views, with_room), prefill)

    def _loads(self, views: list[WorkerCapacity], fits: list[bool]) -> list[WorkerLoad]:
        """What each worker has ahead of a newcomer (its reported backlog plus prompts admitted since)."""
        return [WorkerLoad(v.prefill_backlog + self._pending_prefill(v), v.prefill_tps, v.step_s, fit)
                for v, fit in zip(views, fits, strict=True)]

    def drain_rate(self) -> float:
        """KV tokens per second released recently (0.0 when nothing was released in the window)."""
        now = self._clock()
        self._prune_drained(now)
        if not self._drained:
            return 0.0
        span = max(1.0, now - self._drained[0][0])
        return self._drained_sum / span

    # ---- internals --------------------------------------------------------------------------------
    def _ahead(self, priority: Priority, prefill: bool = False) -> int:
        """KV cost (or prompt tokens) of the waiters served before a newcomer of `priority`."""
        classes = (INTERACTIVE,) if priority == INTERACTIVE else (INTERACTIVE, BATCH)
        return sum(w.prefill if prefill else w.cost for p in classes for w in self._waiters.waiters(p))

    def _deficit(self, cost: int, priority: Priority, views: list[WorkerCapacity]) -> int:
        best = max((self._headroom(v, priority) for v in views), default=0)
        return max(0, cost + self._ahead(priority) - best)

    def _pending_prefill(self, view: WorkerCapacity) -> int:
        """Prompt tokens admitted to the worker since its stats sample (not in its reported backlog)."""
        tickets = self._pending.get(view.worker_id, ())
        return sum(t.prefill for t in tickets if t.admitted_at >= view.updated_at)

    def _check_slo(self, cost: int, prefill: int, priority: Priority, views: list[WorkerCapacity],
                   slo: TtftTarget) -> None:
        predicted = self.predict_ttft_s(cost, prefill, priority, views)
        left = slo.deadline - self._clock()
        if predicted > left:
            retry = excess_retry_s(predicted, left, self.min_retry_s, self.max_retry_s)
            raise self._unattainable(slo, priority, retry, f"predicted {predicted * 1000:.0f} ms")

    def _unattainable(self, slo: TtftTarget, priority: Priority, retry: float, why: str) -> TtftUnattainable:
        self.slo_shed[priority] += 1
        return TtftUnattainable(retry, f"The time-to-first-token target of {slo.target_ms} ms cannot be met "
                                       f"({why}); retry after {retry:g}s.", priority)

    def _record_drain(self, cost: int) -> None:
        now = self._clock()
        self._prune_drained(now)
        if self._drained and now - self._drained[-1][0] < DRAIN_BIN_S:
            self._drained[-1][1] += cost
        else:
            self._drained.append([now, cost])
        self._drained_sum += cost

    def _prune_drained(self, now: float) -> None:
        while self._drained and now - self._drained[0][0] > DRAIN_WINDOW_S:
            self._drained_sum -= int(self._drained.popleft()[1])

    def _live_views(self) -> list[WorkerCapacity]:
        return [v for v in self._views() if not v.draining and v.kv_total > 0]

    def _blocked(self, priority: Priority) -> bool:
        """A newcomer may not pass waiters of its own or a higher priority (it queues; `notify` orders)."""
        if self._waiters.count(INTERACTIVE):
            return True
        return priority == BATCH and bool(self._waiters.count(BATCH))

    def _headroom(self, view: WorkerCapacity, priority: Priority) -> int:
        pending = sum(t.cost for t in self._pending.get(view.worker_id, ())
                      if t.admitted_at >= view.updated_at)
        room = view.kv_free - view.queued_tokens - pending
        if priority == BATCH:
            room -= int(self.interactive_reserve * view.kv_total)
        return room

    def _try_admit(self, cost: int, priority: Priority, views: list[WorkerCapacity],
                   key: str, prefill: int = 0) -> CapacityTicket | None:
        best, best_room = None, -1
        for view in views:
            room = self._headroom(view, priority)
            if room >= cost and room > best_room:
                best, best_room = view, room
        if best is None:
            return None
        now = self._clock()
        ticket = CapacityTicket(cost, priority, best.worker_id, now, key=key, prefill=prefill)
        self._waiters.charge(key, cost)
        if self._outstanding == 0 and self._idle_since is not None and now - self._idle_since > IDLE_RESET_S:
            self._drained.clear()  # a new busy period: releases before the idle gap say nothing of now
            self._drained_sum = 0
        self._outstanding += 1
        self._pending.setdefault(best.worker_id, []).append(ticket)
        return ticket

    def _abandon(self, waiter: Waiter) -> None:
        self._waiters.remove(waiter)
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            # admitted just as we gave up (acquire deactivates the key)
            self._give_back(waiter.future.result())
        else:
            waiter.future.cancel()
        self.notify()  # a blocked head may have left: let the next ones try

    def _overloaded(self, cost: int, priority: Priority, why: str) -> Overloaded:
        self.shed[priority] += 1
        retry = self.retry_after_s(cost, priority)
        return Overloaded(retry, f"Server overloaded ({why}); retry after {retry:g}s.")
