"""Capacity admission: admit a request when some live worker has room for its KV tokens, else queue or
shed it.

Pure asyncio over a callable of per-worker views (`WorkerCapacity`); `notify()` on new stats, `release()`
on ends.
Waiters are served fairly across tenants within a priority class (`admission.fair_waiters`).
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


class Overloaded(Exception):
    """No capacity within the wait budget: 503 server_overloaded with `retry-after`."""

    def __init__(self, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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

    # ---- public API -------------------------------------------------------------------------------
    async def acquire(self, cost: int, priority: Priority, key: str = "",
                      weight: float = 1.0) -> CapacityTicket:
        """Admit now, or wait up to `admission_wait_ms`; raises Overloaded or CapacityNeverFits.

        `key`/`weight`: the tenant and its share among the waiters of its priority class.
        """
        if priority not in (INTERACTIVE, BATCH):
            raise ValueError(f"priority must be a Priority, got {priority!r}")
        if cost < 0:
            raise ValueError("cost must be >= 0")
        self._waiters.activate(key, weight)
        try:
            return await self._acquire(cost, Priority(priority), key)
        except BaseException:
            self._waiters.deactivate(key)
            raise

    async def _acquire(self, cost: int, priority: Priority, key: str) -> CapacityTicket:
        views = self._live_views()
        if views and cost > max(v.kv_total for v in views):
            raise CapacityNeverFits(f"request needs {cost} KV tokens; the largest worker holds "
                                    f"{max(v.kv_total for v in views)}")
        if not self._blocked(priority):
            ticket = self._try_admit(cost, priority, views, key)
            if ticket is not None:
                return ticket
        waiters = self._waiters
        if waiters.count(priority) >= self.max_queue:
            pushed = waiters.push_out(priority, key)
            if pushed is None:
                raise self._overloaded(cost, priority, "admission queue full")
            pushed.future.set_exception(self._overloaded(pushed.cost, priority, "admission queue full"))
        waiter = waiters.new_waiter(cost, priority, key)
        waiters.push(waiter)
        if waiters.fair:
            self.notify()  # the newcomer may be the fairest head
        try:
            await asyncio.wait({waiter.future}, timeout=self.admission_wait_s)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if waiter.future.done():
            return waiter.future.result()  # a ticket, or Overloaded when pushed out of a full queue
        self._abandon(waiter)
        # the wait is charged like an admission: a key shed after holding the queue's head does not keep the
        # lowest counter, so it cannot hold the head again and again at no cost
        self._waiters.charge(key, cost)
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
                ticket = self._try_admit(waiter.cost, priority, views, waiter.key)
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
        views = self._live_views()
        best = max((self._headroom(v, priority) for v in views), default=0)
        ahead = sum(w.cost for w in self._waiters.waiters(INTERACTIVE))
        if priority == BATCH:
            ahead += sum(w.cost for w in self._waiters.waiters(BATCH))
        deficit = max(0, cost + ahead - best)
        rate = self.drain_rate()
        seconds = deficit / rate if rate > 0 else self.fallback_retry_s
        return float(min(self.max_retry_s, max(self.min_retry_s, math.ceil(seconds * 10) / 10)))

    def drain_rate(self) -> float:
        """KV tokens per second released recently (0.0 when nothing was released in the window)."""
        now = self._clock()
        self._prune_drained(now)
        if not self._drained:
            return 0.0
        span = max(1.0, now - self._drained[0][0])
        return self._drained_sum / span

    # ---- internals --------------------------------------------------------------------------------
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
                   key: str) -> CapacityTicket | None:
        best, best_room = None, -1
        for view in views:
            room = self._headroom(view, priority)
            if room >= cost and room > best_room:
                best, best_room = view, room
        if best is None:
            return None
        now = self._clock()
        ticket = CapacityTicket(cost, priority, best.worker_id, now, key=key)
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
