"""Waiters for KV capacity, fair across tenants: per priority class, the head of the tenant with the least
admitted cost per weight goes first (a virtual counter, lifted on activation as in VTC); FIFO on request.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from common.priorities import Priority


@dataclass(slots=True, eq=False)
class Waiter:
    cost: int
    priority: Priority
    key: str
    seq: int  # arrival number: FIFO order, and ties between keys
    future: asyncio.Future = field(repr=False)
    prefill: int = 0  # prompt tokens to compute (TTFT prediction)


@dataclass(slots=True, eq=False)
class _Account:
    counter: float = 0.0  # admitted cost / weight, lifted when the key becomes active
    weight: float = 1.0
    active: int = 0  # requests of the key in the gate: waiting or holding a ticket


class FairWaiters:
    """Per priority class, one deque of waiters per key; `head` picks the next one to try.

    `fair=False`: the oldest waiter of the class (plain FIFO); the counters are still kept.
    Accounts of keys with no request in the gate are forgotten beyond `max_idle_keys` (oldest first).
    """

    def __init__(self, fair: bool = True, max_idle_keys: int = 1024) -> None:
        if max_idle_keys < 0:
            raise ValueError("max_idle_keys must be >= 0")
        self.fair = fair
        self.max_idle_keys = max_idle_keys
        self._accounts: dict[str, _Account] = {}
        self._active: dict[str, _Account] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._floor = 0.0  # counter of the last key to go idle while none stayed active
        self._queues: dict[Priority, dict[str, deque[Waiter]]] = {p: {} for p in Priority}
        self._counts: dict[Priority, int] = dict.fromkeys(Priority, 0)
        self._seq = 0

    # ---- accounts ----

    def activate(self, key: str, weight: float = 1.0) -> None:
        """A request of `key` enters the gate; the key's first one lifts its counter to the active minimum."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be finite and > 0, got {weight!r}")
        acc = self._accounts.get(key)
        if acc is None:
            acc = self._accounts[key] = _Account()
        acc.weight = float(weight)
        if acc.active == 0:
            self._idle.pop(key, None)
            low = min((a.counter for a in self._active.values()), default=self._floor)
            acc.counter = max(acc.counter, low)
            self._active[key] = acc
        acc.active += 1

    def deactivate(self, key: str) -> None:
        """A request of `key` left the gate (released, shed or cancelled)."""
        acc = self._accounts.get(key)
        if acc is None or acc.active == 0:
            return
        acc.active -= 1
        if acc.active == 0:
            del self._active[key]
            if not self._active:
                self._floor = acc.counter
            self._idle[key] = None
            while len(self._idle) > self.max_idle_keys:
                del self._accounts[self._idle.popitem(last=False)[0]]

    def charge(self, key: str, cost: int) -> None:
        """An admission of `cost` KV tokens for `key`."""
        acc = self._accounts.get(key)
        if acc is not None:
            acc.counter += cost / acc.weight

    def counter(self, key: str) -> float:
        acc = self._accounts.get(key)
        return acc.counter if acc is not None else 0.0

    def __len__(self) -> int:
        """Keys with an account (active ones plus at most `max_idle_keys` idle ones)."""
        return len(self._accounts)

    # ---- waiters ----

    def new_waiter(self, cost: int, priority: Priority, key: str, prefill: int = 0) -> Waiter:
        self._seq += 1
        return Waiter(cost, priority, key, self._seq, asyncio.get_running_loop().create_future(), prefill)

    def push(self, waiter: Waiter) -> None:
        self._queues[waiter.priority].setdefault(waiter.key, deque()).append(waiter)
        self._counts[waiter.priority] += 1

    def remove(self, waiter: Waiter) -> bool:
        """Take `waiter` out of its queue; False if it was not there."""
        queues = self._queues[waiter.priority]
        q = queues.get(waiter.key)
        if q is None:
            return False
        try:
            q.remove(waiter)  # the head almost always (served), or an abandoned one
        except ValueError:
            return False
        if not q:
            del queues[waiter.key]
        self._counts[waiter.priority] -= 1
        return True

    def head(self, priority: Priority) -> Waiter | None:
        """The waiter to try next: the head of the key with the lowest counter; ties go to the key with fewer
        requests in the gate (a newly active key is lifted to the minimum), then the oldest. FIFO mode: the
        oldest. O(keys waiting)."""
        best: Waiter | None = None
        best_rank: tuple[float, int, int] = (math.inf, 0, 0)
        accounts, fair = self._accounts, self.fair
        for key, q in self._queues[priority].items():
            w = q[0]
            acc = accounts.get(key) if fair else None
            rank = (acc.counter, acc.active, w.seq) if acc is not None else (0.0, 0, w.seq)
            if best is None or rank < best_rank:
                best, best_rank = w, rank
        return best

    def count(self, priority: Priority) -> int:
        return self._counts[priority]

    def waiters(self, priority: Priority) -> Iterator[Waiter]:
        for q in self._queues[priority].values():
            yield from q

    def push_out(self, priority: Priority, key: str) -> Waiter | None:
        """The queue is full and `key` wants in: the newest waiter of the key with the most waiters, if that
        key would still have more than `key` after the swap (None: the newcomer is the one to shed)."""
        if not self.fair:
            return None
        queues = self._queues[priority]
        longest = max(queues, key=lambda k: len(queues[k]), default=None)
        own = len(queues.get(key, ()))
        if longest is None or longest == key or len(queues[longest]) <= own + 1:
            return None
        victim = queues[longest][-1]
        self.remove(victim)
        return victim
