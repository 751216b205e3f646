"""Fair share between tenants inside one worker: the Virtual Token Counter (VTC) of Sheng et al., OSDI 2024.

Each opaque fairness key counts the service it got (computed prefill and decode tokens, weighted, divided
by the key's weight); admission serves the lowest counter first and preemption hits the highest.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from common.priorities import MAX_WEIGHT
from worker.protocol import MAX_FKEY_LEN, bad_request

POLICIES = ("vtc", "fifo")


def check_fair_params(fkey: object, weight: object) -> None:
    """Raise bad_request unless fkey is bytes of at most MAX_FKEY_LEN and weight a finite number in (0,
    MAX_WEIGHT]."""
    if not isinstance(fkey, bytes) or len(fkey) > MAX_FKEY_LEN:
        raise bad_request(f"fkey must be bytes of at most {MAX_FKEY_LEN}", "fkey")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
        raise bad_request(f"weight must be a finite number in (0, {MAX_WEIGHT:g}]", "weight")


class FairItem(Protocol):
    """What `pick` needs of a waiting request: its fairness key and its engine-wide arrival number."""

    @property
    def fkey(self) -> bytes: ...

    @property
    def arrival(self) -> int: ...


T = TypeVar("T", bound=FairItem)


@dataclass(slots=True, eq=False)
class KeyState:
    weight: float = 1.0
    counter: float = 0.0  # virtual service: charged cost / weight, lifted on activation
    service: float = 0.0  # charged cost, unweighted (metrics)
    active: int = 0  # waiting + running requests
    idle_since: float = 0.0
    in_heap: bool = False  # has an entry in FairShare._heap


class FairShare:
    """VTC counters per fairness key; `policy="fifo"` keeps the accounting but orders by arrival only.

    Call `on_active` when a request of a key enters the engine and `on_idle` when it leaves (finish or
    abort; a preemption is neither), and `charge` once per step per scheduled sequence.
    """

    def __init__(self, policy: str = "vtc", *, w_prefill: float = 1.0, w_decode: float = 2.0,
                 max_keys: int = 1024, idle_ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fairness policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not (w_prefill >= 0 and w_decode >= 0 and math.isfinite(w_prefill + w_decode)):
            raise ValueError("token weights must be finite and >= 0")
        if max_keys < 1 or not idle_ttl_s > 0:
            raise ValueError("max_keys must be >= 1 and idle_ttl_s > 0")
        self.policy = policy
        self.fair = policy == "vtc"
        self.w_prefill, self.w_decode = float(w_prefill), float(w_decode)
        self.max_keys, self.idle_ttl_s = max_keys, idle_ttl_s
        self._clock = clock
        self._keys: dict[bytes, KeyState] = {}
        # keys without active requests, longest idle first
        self._idle: OrderedDict[bytes, None] = OrderedDict()
        # Lazy min-heap over active keys' counters: an entry's value never exceeds its key's counter
        # (counters only grow), so a stale top is re-pushed with the current value when read.
        self._heap: list[tuple[float, int, bytes, KeyState]] = []
        self._tick = 0
        self._num_active = 0
        self._active_weight = 0.0  # sum of the active keys' weights (slot shares)
        self._floor = 0.0  # counter of the last key to go idle when none was left active

    # ---- request lifecycle ----

    def on_active(self, key: bytes, weight: float = 1.0) -> None:
        """A request of `key` entered; the key's first one lifts its counter to the active minimum."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be finite and > 0, got {weight!r}")
        st = self._keys.get(key)
        if st is None:
            st = self._keys[key] = KeyState()
        if st.active:
            self._active_weight += float(weight) - st.weight
        st.weight = float(weight)
        if st.active == 0:
            self._active_weight += st.weight
            self._idle.pop(key, None)
            low = self._min_active()
            st.counter = max(st.counter, self._floor if low is None else low)
            self._num_active += 1
            if not st.in_heap:
                self._push(key, st)
        st.active += 1
        self.expire()

    def on_idle(self, key: bytes) -> None:
        """A request of `key` left the engine; with its last one the key becomes idle (evictable)."""
        st = self._keys.get(key)
        if st is None or st.active == 0:
            return
        st.active -= 1
        if st.active == 0:
            self._num_active -= 1
            self._active_weight = self._active_weight - st.weight if self._num_active else 0.0
            st.idle_since = self._clock()
            self._idle[key] = None
            if self._num_active == 0:
                self._floor = st.counter
        self.expire()

    def charge(self, key: bytes, prefill_computed: int = 0, decode: int = 0) -> None:
        """Service of one step: prefill tokens run through the model (cache hits excluded) and decodes."""
        st = self._keys.get(key)
        if st is None:
            return  # not active: nothing to account to (active keys are never forgotten)
        cost = self.w_prefill * prefill_computed + self.w_decode * decode
        st.service += cost
        st.counter += cost / st.weight

    # ---- decisions ----

    def pick(self, candidates: Iterable[T]) -> T | None:
        """The candidate whose key has the lowest counter, ties (and FIFO mode) by arrival; None if empty."""
        keys, fair = self._keys, self.fair
        best: T | None = None
        best_c = best_a = math.inf
        for item in candidates:
            c = 0.0
            if fair:
                st = keys.get(item.fkey)
                if st is not None:
                    c = st.counter
            a = item.arrival
            if c < best_c or (c == best_c and a < best_a):
                best, best_c, best_a = item, c, a
        return best

    def preemption_victim(self, keys_with_running: Iterable[bytes]) -> bytes | None:
        """The key most over its share (highest counter; first on ties); None in FIFO mode or if none."""
        if not self.fair:
            return None
        best: bytes | None = None
        best_c = -math.inf
        for key in keys_with_running:
            st = self._keys.get(key)
            c = st.counter if st is not None else 0.0
            if c > best_c:
                best, best_c = key, c
        return best

    def slot_victim(self, head: bytes, running: dict[bytes, int], slots: int, gap: float) -> bytes | None:
        """Fair-share preemption: the key to take one running slot from so that `head`'s key gets one, or
        None.

        `running`: running sequences per key (those that may be preempted for head). A key's share of `slots`
        is slots x weight / (sum of the active keys' weights). Only when head's key stays within its share
        after gaining the slot, the victim stays at or above its own after losing it (so the reverse move
        can never follow: no thrash), and the victim's counter is at least head's + `gap` (a newly active key
        is lifted to the minimum, so with gap 0 it may take a slot at once). The victim: the highest counter.
        """
        if not self.fair or self._num_active < 2:
            return None
        keys, total = self._keys, self._active_weight
        hs = keys.get(head)
        if hs is None or not total > 0 or running.get(head, 0) + 1 > slots * hs.weight / total:
            return None
        best: bytes | None = None
        best_c = hs.counter + gap
        for key, n in running.items():
            st = keys.get(key)
            if key == head or st is None or n - 1 < slots * st.weight / total:
                continue
            if st.counter >= best_c:
                best, best_c = key, st.counter
        return best

    def over_share(self, key: bytes, running: int, slots: int) -> bool:
        """True when `key` runs more sequences than its share of `slots` (VTC with several active keys)."""
        st = self._keys.get(key)
        if not self.fair or self._num_active < 2 or st is None or not self._active_weight > 0:
            return False
        return running > slots * st.weight / self._active_weight

    def under_share(self, key: bytes, running: int, slots: int) -> bool:
        """True when `key` runs fewer sequences than its share of `slots` (VTC with several active keys)."""
        st = self._keys.get(key)
        if not self.fair or self._num_active < 2 or st is None or not self._active_weight > 0:
            return False
        return running < slots * st.weight / self._active_weight

    # ---- state bound ----

    def expire(self) -> None:
        """Forget idle keys beyond `max_keys` (least recently active first) or idle for `idle_ttl_s`."""
        idle, keys = self._idle, self._keys
        if not idle:
            return
        now = self._clock()
        while idle:
            key = next(iter(idle))
            if len(keys) <= self.max_keys and now - keys[key].idle_since < self.idle_ttl_s:
                break
            del idle[key]
            del keys[key]

    # ---- reading ----

    def service(self, key: bytes) -> float:
        """Cost charged to `key` (w_p x computed prefill + w_d x decode), not divided by its weight."""
        st = self._keys.get(key)
        return st.service if st is not None else 0.0

    def counter(self, key: bytes) -> float:
        st = self._keys.get(key)
        return st.counter if st is not None else 0.0

    def active_requests(self, key: bytes) -> int:
        st = self._keys.get(key)
        return st.active if st is not None else 0

    @property
    def active_keys(self) -> int:
        """Keys with at least one waiting or running request."""
        return self._num_active

    def min_active_counter(self) -> float | None:
        return self._min_active()

    def top_service(self, n: int) -> list[tuple[bytes, float]]:
        """The `n` keys with the most service (bounded metric labels)."""
        return heapq.nlargest(n, ((k, st.service) for k, st in self._keys.items()), key=lambda kv: kv[1])

    def services(self) -> Iterable[tuple[bytes, float]]:
        """(key, service) of every tracked key (at most `max_keys` idle ones plus the active ones)."""
        return ((k, st.service) for k, st in self._keys.items())

    def __len__(self) -> int:
        return len(self._keys)

    # ---- internals ----

    def _push(self, key: bytes, st: KeyState) -> None:
        if len(self._heap) > 2 * self._num_active + 64:
            self._rebuild()
            if st.in_heap:
                return
        self._tick += 1
        heapq.heappush(self._heap, (st.counter, self._tick, key, st))
        st.in_heap = True

    def _rebuild(self) -> None:
        for entry in self._heap:
            entry[3].in_heap = False
        self._heap = []
        for key, st in self._keys.items():
            if st.active:
                self._tick += 1
                self._heap.append((st.counter, self._tick, key, st))
                st.in_heap = True
        heapq.heapify(self._heap)

    def _min_active(self) -> float | None:
        heap, keys = self._heap, self._keys
        while heap:
            value, _, key, st = heap[0]
            if st.active == 0 or keys.get(key) is not st:
                heapq.heappop(heap)
                st.in_heap = False
            elif value < st.counter:
                self._tick += 1
                heapq.heapreplace(heap, (st.counter, self._tick, key, st))
            else:
                return value
        return None
