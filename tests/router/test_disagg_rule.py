"""The disaggregation rule on its own: the lacking-token threshold, the choice of prefill worker (most held,
then shortest queue), busy prefill workers, roles, and the in-flight count of unacknowledged prefills."""

from __future__ import annotations

import pytest

from common.worker_registry import Registration
from router.disagg.prefill_target import (
    REASON_NO_PREFILL_WORKER,
    REASON_PREFILL_QUEUE,
    REASON_SHORT,
    Disaggregation,
    DisaggRule,
    PrefillCandidate,
    decide,
    member_role,
)
from router.links.membership import Member
from router.placement.prefix import token_count
from worker.protocol import PROTOCOL_VERSION, PrefillHint, WorkerStats

RULE = DisaggRule(min_tokens=512, max_prefill_queue=4)


def cand(wid: str, held: int = 0, queue: int = 0) -> PrefillCandidate:
    return PrefillCandidate(wid, f"tcp://{wid}:1", held, queue)


def test_lacking_tokens_below_the_threshold_stay_local() -> None:
    assert decide(511, [cand("p")], RULE) == (None, REASON_SHORT)
    assert decide(0, [cand("p")], RULE) == (None, REASON_SHORT)
    # the decode worker holds more than the prompt
    assert decide(-5, [cand("p")], RULE) == (None, REASON_SHORT)
    assert decide(512, [cand("p")], RULE) == (PrefillHint("p", "tcp://p:1"), None)  # at the threshold: remote
    assert decide(600, [cand("p")], DisaggRule(min_tokens=601)) == (None, REASON_SHORT)


def test_no_live_prefill_worker_stays_local() -> None:
    assert decide(10_000, [], RULE) == (None, REASON_NO_PREFILL_WORKER)


def test_the_prefill_worker_holding_most_of_the_prompt_wins_then_the_shortest_queue() -> None:
    hint, _ = decide(2000, [cand("a", held=0, queue=0), cand("b", held=256, queue=3),
                            cand("c", held=128)], RULE)
    assert hint is not None and hint.worker_id == "b"  # held beats a shorter queue
    hint, _ = decide(2000, [cand("a", queue=2), cand("b", queue=1), cand("c", queue=3)], RULE)
    assert hint is not None and hint.worker_id == "b"
    hint, _ = decide(2000, [cand("b", queue=1), cand("a", queue=1)], RULE)
    assert hint is not None and hint.worker_id == "a"  # full tie: the smallest id, whatever the order given


def test_busy_prefill_workers_are_passed_over_and_all_busy_stays_local() -> None:
    busy_holder = cand("a", held=1024, queue=5)  # over max_prefill_queue: busy, whatever it holds
    hint, reason = decide(2000, [busy_holder, cand("b", queue=4)], RULE)
    assert reason is None and hint is not None and hint.worker_id == "b"  # at the bound still takes work
    assert decide(2000, [busy_holder, cand("b", queue=9)], RULE) == (None, REASON_PREFILL_QUEUE)
    zero = DisaggRule(min_tokens=1, max_prefill_queue=0)  # only an idle prefill worker takes a prefill
    assert decide(5, [cand("b", queue=1)], zero) == (None, REASON_PREFILL_QUEUE)
    assert decide(5, [cand("b", queue=0)], zero)[0] == PrefillHint("b", "tcp://b:1")


def test_rule_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        DisaggRule(min_tokens=0)
    with pytest.raises(ValueError):
        DisaggRule(max_prefill_queue=-1)
    assert DisaggRule() == DisaggRule(512, 4)


def _stats(role: str = "both", queue: int = 0, running: int = 0, draining: bool = False) -> WorkerStats:
    s = WorkerStats("w", queue, running, 100, 100, 0.0, draining, "m", PROTOCOL_VERSION)
    s.role = role
    return s


def test_member_role_comes_from_stats_else_registration_else_both() -> None:
    reg = Registration("w", "tcp://w:1", "m", PROTOCOL_VERSION, 0.0, role="prefill")
    assert member_role(None) == "both"
    assert member_role(Member("w", "tcp://w:1", None)) == "both"  # type: ignore[arg-type]
    assert member_role(Member("w", "tcp://w:1", None, registration=reg)) == "prefill"  # type: ignore[arg-type]
    assert member_role(Member("w", "tcp://w:1", None, stats=_stats("decode"),
                              registration=reg)) == "decode"  # type: ignore[arg-type]


def test_token_count_counts_ids_and_packed_tokens() -> None:
    assert token_count([1, 2, 3]) == 3 and token_count(b"\0" * 12) == 3


class Members:
    """The two Membership queries Disaggregation reads, over hand-made members."""

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.dead: set[str] = set()

    def add(self, wid: str, stats: WorkerStats) -> None:
        self.members[wid] = Member(wid, f"tcp://{wid}:1", None, stats=stats,
                                   stats_at=0.0)  # type: ignore[arg-type]

    def member(self, mid: str) -> Member | None:
        return self.members.get(mid)

    def status(self, mid: str) -> str | None:
        m = self.members.get(mid)
        if m is None or mid in self.dead:
            return "dead"
        return "draining" if m.stats is not None and m.stats.draining else None


class Ring:
    def __init__(self) -> None:
        self.members: set[str] = set()

    def add(self, wid: str) -> None:
        self.members.add(wid)

    def remove(self, wid: str) -> None:
        self.members.discard(wid)


def test_roles_place_workers_on_or_off_the_ring_and_report_changes() -> None:
    d, ring = Disaggregation(Members(), RULE, lambda _w: False), Ring()
    assert d.place("a", "both", ring) is False and ring.members == {"a"}
    assert d.place("d", "decode", ring) is False and ring.members == {"a", "d"}
    assert d.place("p", "prefill", ring) is True and ring.members == {"a", "d"} and d.ids == {"p"}
    assert d.place("p", "prefill", ring) is False  # the same role again: no change
    assert d.place("a", "prefill", ring) is True and ring.members == {"d"}
    assert d.place("a", "decode", ring) is True and ring.members == {"a", "d"} and d.ids == {"p"}


def test_candidates_are_live_compatible_prefill_workers_with_their_queues() -> None:
    m = Members()
    m.add("p1", _stats("prefill", queue=2, running=1))
    m.add("p2", _stats("prefill", draining=True))
    m.add("p3", _stats("prefill"))
    m.add("p4", _stats("prefill"))
    m.dead.add("p3")
    d = Disaggregation(m, RULE, lambda w: w == "p4")  # p4's block-hash contract was refused
    for w in ("p1", "p2", "p3", "p4"):
        d.set_role(w, "prefill")
    assert d.candidates({"p1": 64, "x": 9}) == [PrefillCandidate("p1", "tcp://p1:1", 64, 3)]


def test_unacknowledged_prefills_count_in_the_queue_until_done() -> None:
    m = Members()
    m.add("p", _stats("prefill", queue=1))
    d = Disaggregation(m, DisaggRule(min_tokens=1, max_prefill_queue=2), lambda _w: False)
    d.set_role("p", "prefill")
    first = d.choose("r1", 100, {})
    second = d.choose("r2", 100, {})
    assert first == second == PrefillHint("p", "tcp://p:1")
    assert d.inflight("p") == 2 and d.candidates({})[0].queue == 3
    assert d.choose("r3", 100, {}) is None  # 1 reported + 2 in flight > 2: busy
    assert d.inflight("p") == 2  # a local decision sends nothing
    d.done(first, "r1")
    d.done(first, "r1")  # idempotent: the first output and the attempt's end both call it
    d.done(None, "r2")  # a local attempt has nothing to acknowledge
    assert d.inflight("p") == 1
    d.forget("p")
    assert d.inflight("p") == 0 and d.ids == set()
    d.done(second, "r2")  # after the worker left: a no-op
    assert d.inflight("p") == 0
