"""Routing credit for KV tiers: a worker's tier-held blocks (tadd/tdel) count below memory-held ones, reports
without tiers read as before, and a routed pick prefers the memory holder, then the tier holder, over a
stranger."""

from __future__ import annotations

import random

from router import RouteRequest
from router.placement.kv_index import Applied, KvIndex
from router.placement.kv_view import TIER_CREDIT
from tests.router.test_router_kv_index import CONTRACT, NS, replica, stats
from worker.protocol import KvReport, block_ids
from worker.protocol.stats import decode_kv, kv_fields


def report(seq: int, stored=(), evicted=(), tiered=(), untiered=(), snapshot=False) -> KvReport:
    return KvReport(CONTRACT, 7, seq, snapshot, list(stored), list(evicted), list(tiered), list(untiered))


def test_tier_changes_apply_and_match_counts_tier_blocks_after_memory_ones() -> None:
    idx = KvIndex()
    assert idx.apply("w", report(0, [1, 2], tiered=[3, 4, 9], snapshot=True), 100) is Applied.APPLIED
    assert idx.match_tiered([1, 2, 3, 4, 5], ["w"]) == {"w": (2, 2)}
    assert idx.apply("w", report(1, untiered=[4]), 100) is Applied.APPLIED  # a report with tier changes only
    assert idx.match_tiered([1, 2, 3, 4], ["w"]) == {"w": (2, 1)}
    assert idx.apply("w", report(2, evicted=[1, 2], tiered=[1, 2]), 100) is Applied.APPLIED
    assert idx.match_tiered([1, 2, 3], ["w"]) == {"w": (0, 3)} and idx.match([1, 2, 3], ["w"]) == {}
    # a snapshot replaces the tiers
    assert idx.apply("w", report(3, [7], snapshot=True), 100) is Applied.APPLIED
    assert idx.match_tiered([1, 2], ["w"]) == {}


def test_the_tier_set_is_bounded() -> None:
    idx = KvIndex(max_tier_blocks=3)
    idx.apply("w", report(0, [1], tiered=[2, 3, 4, 5], snapshot=True), 100)
    assert idx.match_tiered([1, 2], ["w"]) == {"w": (1, 0)}  # over the bound: no tier credit, memory kept


def test_wire_form_is_compatible() -> None:
    plain = kv_fields(report(1, [1], [2]))
    assert "tadd" not in plain and "tdel" not in plain
    assert decode_kv(plain).tiered == [] and decode_kv(plain).untiered == []
    back = decode_kv(kv_fields(report(1, [1], tiered=[5, 6], untiered=[8])))
    assert back.tiered == [5, 6] and back.untiered == [8]


async def test_memory_holder_beats_tier_holder_beats_stranger() -> None:
    eps = [f"tcp://127.0.0.1:{5200 + i}" for i in range(3)]
    r = await replica(eps, "gw")
    prompt = [random.Random(5).randrange(100, 30000) for _ in range(200)]
    ids = block_ids(NS, prompt, 16)[:8]
    r.membership.observe(eps[0], stats(eps[0], report(0, ids, snapshot=True)))
    r.membership.observe(eps[1], stats(eps[1], report(0, tiered=ids, snapshot=True)))
    r.membership.observe(eps[2], stats(eps[2], report(0, [12345], snapshot=True)))
    matched = r.kv.matched(NS, prompt, r.policy.members)
    assert matched == {eps[0]: 128, eps[1]: int(128 * TIER_CREDIT)}
    key = r.key_for(RouteRequest("x", NS, prompt, 300))
    assert r.pick(key, 300, span=128, matched=matched).worker_id == eps[0]
    r.membership.observe(eps[0], stats(eps[0], report(1, evicted=ids)))  # memory holder drops it
    matched = r.kv.matched(NS, prompt, r.policy.members)
    assert matched == {eps[1]: int(128 * TIER_CREDIT)}
    assert r.pick(key, 300, span=128, matched=matched).worker_id == eps[1]
