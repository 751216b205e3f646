"""Conditional disaggregation: whether a request's prefill runs on a prefill-role worker, and on which one.

`decide` is the pure rule; `Disaggregation` keeps a Router's prefill-role members and their in-flight
prefills.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.links.membership import Member
from router.placement import routing_metrics
from worker.protocol import PrefillHint

ROLE_BOTH = "both"  # takes gen requests and prefills them itself
ROLE_PREFILL = "prefill"  # only prefills for decode workers: never sent a gen
ROLE_DECODE = "decode"  # takes gen requests; may be told to receive a prompt's pages from a prefill worker

DEFAULT_DISAGG_MIN_TOKENS = 512
DEFAULT_DISAGG_MAX_PREFILL_QUEUE = 4

OUTCOME_REMOTE = "remote"  # prefilled on a prefill worker
OUTCOME_LOCAL = "local"  # prefilled by the decode worker itself
REASON_SHORT = "short"  # the decode worker lacks fewer than min_tokens of the prompt
REASON_NO_PREFILL_WORKER = "no_prefill_worker"  # the pool has prefill-role workers, none live
REASON_PREFILL_QUEUE = "prefill_queue"  # every live prefill worker's queue is over max_prefill_queue


@dataclass(slots=True, frozen=True)
class DisaggRule:
    """Disaggregate when the decode worker lacks at least `min_tokens` of the prompt and some prefill worker
    has at most `max_prefill_queue` prefills queued, running or sent by this gateway and not yet
    acknowledged."""

    min_tokens: int = DEFAULT_DISAGG_MIN_TOKENS
    max_prefill_queue: int = DEFAULT_DISAGG_MAX_PREFILL_QUEUE

    def __post_init__(self) -> None:
        if self.min_tokens < 1 or self.max_prefill_queue < 0:
            raise ValueError("disagg min_tokens must be >= 1 and max_prefill_queue >= 0")


@dataclass(slots=True, frozen=True)
class PrefillCandidate:
    """A live prefill-role worker as one decision sees it."""

    worker_id: str
    endpoint: str
    held: int  # prompt tokens it reports holding (KvView.matched)
    queue: int  # its reported queue + running, plus this gateway's prefills it has not acknowledged


def decide(lacking: int, candidates: Sequence[PrefillCandidate], rule: DisaggRule
           ) -> tuple[PrefillHint | None, str | None]:
    """(hint, None) to prefill on the chosen worker: the most prompt tokens held, then the shortest queue,
    then the smallest id; (None, reason) to prefill on the decode worker. `lacking`: prompt tokens it does
    not hold."""
    if lacking < rule.min_tokens:
        return None, REASON_SHORT
    if not candidates:
        return None, REASON_NO_PREFILL_WORKER
    free = [c for c in candidates if c.queue <= rule.max_prefill_queue]
    if not free:
        return None, REASON_PREFILL_QUEUE
    best = min(free, key=lambda c: (-c.held, c.queue, c.worker_id))
    return PrefillHint(best.worker_id, best.endpoint), None


def member_role(member: Member | None) -> str:
    """A member's role: its latest stats', else its registration's (a worker not yet heard from), else
    both."""
    if member is None:
        return ROLE_BOTH
    if member.stats is not None:
        return member.stats.role
    return member.registration.role if member.registration is not None else ROLE_BOTH


class MemberSource(Protocol):
    """What disaggregation reads of a Membership (or a PoolView)."""

    def member(self, mid: str) -> Member | None: ...

    def status(self, mid: str) -> str | None: ...


class Ring(Protocol):
    """The routing ring's membership (a RoutingPolicy)."""

    def add(self, worker_id: str) -> None: ...

    def remove(self, worker_id: str) -> None: ...


class Disaggregation:
    """A Router's prefill-role members, the prefills this gateway sent each and it has not yet acknowledged
    (the request's first output, or its attempt's end), and the rule applied to each attempt."""

    def __init__(self, membership: MemberSource, rule: DisaggRule, refused: Callable[[str], bool]) -> None:
        self.membership = membership
        self.rule = rule
        self.ids: set[str] = set()  # members whose role is prefill
        self._refused = refused
        self._sent: dict[str, set[str]] = {}  # prefill worker -> request ids of its unacknowledged prefills

    def set_role(self, mid: str, role: str) -> bool:
        """Record `mid`'s role; True when it moved into or out of the prefill role."""
        was = mid in self.ids
        if role == ROLE_PREFILL:
            self.ids.add(mid)
        else:
            self.ids.discard(mid)
        return was != (role == ROLE_PREFILL)

    def place(self, mid: str, role: str, ring: Ring) -> bool:
        """Keep `mid` on the routing ring unless its role is prefill (no gen for it, and no fallback counted
        when a key's walk starts at it); True when its role moved into or out of prefill."""
        changed = self.set_role(mid, role)
        if role == ROLE_PREFILL:
            ring.remove(mid)
        else:
            ring.add(mid)
        return changed

    def forget(self, mid: str) -> None:
        self.ids.discard(mid)
        self._sent.pop(mid, None)

    def inflight(self, mid: str) -> int:
        return len(self._sent.get(mid, ()))

    def candidates(self, matched: Mapping[str, int]) -> list[PrefillCandidate]:
        """The live, compatible prefill-role workers, with the prompt tokens each holds and its queue."""
        out: list[PrefillCandidate] = []
        for mid in sorted(self.ids):
            member = self.membership.member(mid)
            if (member is None or member.stats is None or self.membership.status(mid) is not None
                    or self._refused(mid)):
                continue
            queue = member.stats.queue + member.stats.running + self.inflight(mid)
            out.append(PrefillCandidate(mid, member.endpoint, matched.get(mid, 0), queue))
        return out

    def choose(self, rid: str, lacking: int, matched: Mapping[str, int]) -> PrefillHint | None:
        """Apply the rule to one attempt of request `rid`, count its outcome, and count a remote prefill as in
        flight until `done`. None: the decode worker prefills. With no prefill-role member the rule is skipped
        (outcome local, no fallback reason counted)."""
        hint, reason = decide(lacking, self.candidates(matched), self.rule) if self.ids else (None, None)
        routing_metrics.DISAGG_REQUESTS.labels(OUTCOME_LOCAL if hint is None else OUTCOME_REMOTE).inc()
        if reason is not None:
            routing_metrics.DISAGG_FALLBACKS.labels(reason).inc()
        if hint is not None:
            self._sent.setdefault(hint.worker_id, set()).add(rid)
        return hint

    def done(self, hint: PrefillHint | None, rid: str) -> None:
        """The prefill of `rid` is acknowledged (first output) or abandoned (attempt ended); idempotent."""
        if hint is None:
            return
        sent = self._sent.get(hint.worker_id)
        if sent is not None:
            sent.discard(rid)
            if not sent:
                del self._sent[hint.worker_id]
