"""The gateway's KV index: numbered batches, gaps and snapshots, restarts, bounds, refusal of a differing
contract, and two router replicas fed the same reports choosing alike."""

from __future__ import annotations

import logging
import random
import sys
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from router import Membership, Router, RouteRequest, namespace_root
from router.placement.kv_index import Applied, KvIndex
from worker import protocol as proto
from worker.protocol import HASH_ALGO, KvContract, KvReport, WorkerStats, block_ids, frames

CONTRACT = KvContract(16, HASH_ALGO, "tok-1")
NS = namespace_root("m", "tok-1", "tenant", b"secret")


def report(seq: int, stored=(), evicted=(), *, snapshot=False, epoch=7, contract=CONTRACT) -> KvReport:
    return KvReport(contract, epoch, seq, snapshot, list(stored), list(evicted))


def test_batches_apply_in_order_and_duplicates_change_nothing() -> None:
    idx = KvIndex()
    assert idx.apply("w", report(0, [1, 2, 3], snapshot=True), 100) is Applied.APPLIED
    assert idx.apply("w", report(1, [4], [1]), 100) is Applied.APPLIED
    assert idx.apply("w", report(1, [4], [1]), 100) is Applied.CURRENT  # the stats pulse re-sent it
    assert idx.apply("w", report(1), 100) is Applied.CURRENT  # an empty report under the last number
    assert idx.match([2, 3, 4, 5], ["w"]) == {"w": 3}
    assert idx.match([1, 2], ["w"]) == {} and idx.blocks("w") == 3 and idx.total_blocks == 3


def test_a_gap_asks_for_a_snapshot_which_restores_the_view() -> None:
    idx = KvIndex()
    idx.apply("w", report(0, [1], snapshot=True), 100)
    assert idx.apply("w", report(3, [9]), 100) is Applied.GAP  # batches 1 and 2 were lost
    assert not idx.synced("w")
    assert idx.apply("w", report(4, [10]), 100) is Applied.GAP  # still waiting for the snapshot
    assert idx.apply("w", report(4, [1, 5, 9, 10], snapshot=True), 100) is Applied.APPLIED
    assert idx.synced("w") and idx.apply("w", report(5, [11]), 100) is Applied.APPLIED
    assert idx.match([1, 5, 9, 10, 11], ["w"]) == {"w": 5}
    assert idx.apply("w", report(3, [77], snapshot=True), 100) is Applied.CURRENT  # a delayed older snapshot
    # an empty report numbered past ours means a batch went missing too
    assert idx.apply("w", report(7), 100) is Applied.GAP


def test_a_restarted_worker_starts_empty_under_a_new_epoch() -> None:
    idx = KvIndex()
    idx.apply("w", report(5, [1, 2], snapshot=True), 100)
    # its first batch, on an empty view
    assert idx.apply("w", report(1, [8], epoch=8), 100) is Applied.APPLIED
    assert idx.match([1], ["w"]) == {} and idx.match([8], ["w"]) == {"w": 1}
    assert idx.apply("w", report(3, [9], epoch=9), 100) is Applied.GAP  # missed its first batches
    assert idx.blocks("w") == 0


def test_an_oversized_report_is_refused_before_it_is_taken_in() -> None:
    import tracemalloc

    idx = KvIndex(max_blocks=1000)
    big = report(0, range(1_000_000), snapshot=True)
    tracemalloc.start()
    try:
        assert idx.apply("a", big, 100) is Applied.OVERFLOW
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated for a report that was refused"  # a 1M-id set: ~40 MB
    assert idx.blocks("a") == 0 and idx.total_blocks == 0


def test_bounds_per_worker_and_overall() -> None:
    idx = KvIndex(max_blocks=1000)
    # a worker of 100 pages cannot hold 300 blocks: the report is dropped and a snapshot asked for
    assert idx.apply("a", report(0, range(300), snapshot=True), 100) is Applied.OVERFLOW
    assert idx.blocks("a") == 0 and not idx.synced("a")
    assert idx.apply("a", report(0, range(100), snapshot=True), 100) is Applied.APPLIED
    assert idx.apply("b", report(0, range(1000, 1950), snapshot=True), 1000) is Applied.OVERFLOW
    assert idx.total_blocks == 100
    idx.forget("a")
    assert idx.total_blocks == 0


def test_million_block_churn_stays_within_the_stated_memory() -> None:
    """Docs: 1M indexed blocks take at most 80 MB (a Python set of 64-bit ints, ~72 bytes a block)."""
    rng = np.random.default_rng(1)
    idx = KvIndex(max_blocks=2_000_000)
    live = rng.integers(0, 2**63, 1_000_000, dtype=np.int64)
    idx.apply("w", report(0, live.tolist(), snapshot=True), 1_000_000)
    for seq in range(1, 6):  # 5 x 200k evicted and as many new blocks stored: a full turnover
        fresh = rng.integers(0, 2**63, 200_000, dtype=np.int64)
        cut = slice((seq - 1) * 200_000, seq * 200_000)
        assert idx.apply("w", report(seq, fresh.tolist(), live[cut].tolist()), 1_000_000) is Applied.APPLIED
        live[cut] = fresh
    ids = idx._workers["w"].ids
    used = sys.getsizeof(ids) + sum(map(sys.getsizeof, ids))  # the table and every id object in it
    assert used < 80 * 2**20, f"index uses {used / 2**20:.1f} MB"
    assert idx.blocks("w") == idx.total_blocks == 1_000_000
    assert idx.match(live[:3].tolist(), ["w"]) == {"w": 3}


# ---------------------------------------------------------------- through the Router


class FakeClient:
    """Stands in for WorkerClient: the tests feed stats straight into the membership."""

    def __init__(self, endpoint: str, **_: object) -> None:
        self.endpoint = endpoint
        self.syncs = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    silence_limit = 1.0
    link_closed = False

    def silent_for(self) -> float:
        return 0.0

    def request_sync(self) -> None:
        self.syncs += 1


def stats(wid: str, kv: KvReport | None, **kw) -> WorkerStats:
    base = dict(queue=0, running=0, kv_free=4096, kv_total=4096, hit_rate=0.0, draining=False, model="m",
                version=proto.PROTOCOL_VERSION)
    return WorkerStats(worker_id=wid, kv=kv, **(base | kw))


async def replica(endpoints: list[str], name: str) -> Router:
    m = Membership(gateway_id=name, static_endpoints=endpoints, client_factory=FakeClient)
    await m.refresh()
    return Router(m, secret=b"secret", tokenizer_version="tok-1", rng=random.Random(1))


async def test_replicas_fed_the_same_reports_choose_alike() -> None:
    eps = [f"tcp://127.0.0.1:{5000 + i}" for i in range(3)]
    routers = [await replica(eps, "gw-a"), await replica(eps, "gw-b")]
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 30000) for _ in range(200)] for _ in range(12)]
    # each worker holds four of the prompts (the first 8 of their blocks), as its snapshot says
    held = {ep: [i for p in prompts[k::3] for i in block_ids(NS, p, 16)[:8]] for k, ep in enumerate(eps)}
    for r in routers:
        for ep in eps:
            r.membership.observe(ep, stats(ep, report(0, held[ep], snapshot=True)))
    for n, p in enumerate(prompts):
        picks = set()
        for r in routers:
            matched = r.kv.matched(NS, p, r.policy.members)
            assert matched == {eps[n % 3]: 128}
            picks.add(r.pick(r.key_for(RouteRequest('x', NS, p, 300)), 300, span=128,
                             matched=matched).worker_id)
        assert picks == {eps[n % 3]}
    # a prompt nobody reported falls back to the ring and footprints, alike on both (same history here)
    fresh = [rng.randrange(100, 30000) for _ in range(200)]
    assert len({r.pick(r.key_for(RouteRequest('x', NS, fresh, 300)), 300, span=128,
                       matched=r.kv.matched(NS, fresh, r.policy.members)).worker_id for r in routers}) == 1


async def test_a_worker_with_another_contract_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    eps = ["tcp://127.0.0.1:5100", "tcp://127.0.0.1:5101"]
    r = await replica(eps, "gw")
    before = REGISTRY.get_sample_value("switchyard_router_refused_workers_total",
                                       {"reason": "block_size"}) or 0
    with caplog.at_level(logging.ERROR, logger="router.placement.kv_view"):
        r.membership.observe(eps[0], stats(eps[0], report(0, [1], snapshot=True)))
        r.membership.observe(eps[1], stats(eps[1], report(0, [1], snapshot=True,
                                                          contract=KvContract(32, HASH_ALGO, "tok-1"))))
        r.membership.observe(eps[1], stats(eps[1], report(0, [1], snapshot=True,
                                                          contract=KvContract(32, HASH_ALGO, "tok-1"))))
    assert [rec for rec in caplog.records if "refusing worker" in rec.message and "block_size" in rec.message]
    after = REGISTRY.get_sample_value("switchyard_router_refused_workers_total", {"reason": "block_size"})
    assert after == before + 1  # once per refusal, not per frame
    assert r.live() == [eps[0]] and [m.member_id for m in r.reporting()] == [eps[0]]
    assert r.kv.index.blocks(eps[1]) == 0
    for _ in range(20):  # never routed to, keyed or not
        assert r.pick(None, 10).worker_id == eps[0]
    r.membership.observe(eps[1], stats(eps[1], report(0, [1], snapshot=True)))
    assert r.live() == eps  # fixed and restarted: accepted again


async def test_gap_and_corrupt_reports_ask_for_a_snapshot_never_crash() -> None:
    ep = "tcp://127.0.0.1:5200"
    r = await replica([ep], "gw")
    client = r.membership.client(ep)
    r.membership.observe(ep, stats(ep, report(0, [1, 2], snapshot=True)))
    assert client.syncs == 0
    r.membership.observe(ep, stats(ep, report(2, [3])))  # batch 1 lost
    assert client.syncs == 1
    bad = stats(ep, None)
    bad.kv_error = "kv.add is not packed uint64"
    time.sleep(0.11)  # forced requests are spaced 0.1 s apart
    r.membership.observe(ep, bad)
    assert client.syncs == 2 and r.live() == [ep]  # the worker's stats still count
    # and through the wire decoder: a garbled kv part leaves the rest of the frame usable
    frame = frames._pack(proto.stats_fields(stats(ep, None)) | {"kv": {"bs": 16, "add": b"xyz"}})
    decoded = proto.decode_worker_frame(frame)
    assert isinstance(decoded, WorkerStats) and decoded.kv is None and "kv." in decoded.kv_error


async def test_longest_reported_prefix_wins_and_a_common_opening_prefers_no_one() -> None:
    eps = [f"tcp://127.0.0.1:{5300 + i}" for i in range(3)]
    r = await replica(eps, "gw")
    rng = random.Random(9)
    prompt = [rng.randrange(100, 30000) for _ in range(160)]
    ids = block_ids(NS, prompt, 16)
    held = {eps[0]: ids[:1], eps[1]: ids[:6], eps[2]: ids[:3]}  # all share the first block
    for ep in eps:
        r.membership.observe(ep, stats(ep, report(0, held[ep], snapshot=True)))
    matched = r.kv.matched(NS, prompt, r.policy.members)
    assert matched == {eps[0]: 16, eps[1]: 96, eps[2]: 48}
    key = r.key_for(RouteRequest("x", NS, prompt, 300))
    assert r.pick(key, 300, span=128, matched=matched).worker_id == eps[1]
    # every worker holds just the first block (a chat template's opening): no holder, the ring's home decides
    common = {ep: 16 for ep in eps}
    assert r._candidates(key, frozenset(), common).held == {}
    assert r.pick(key, 300, span=128, matched=common).worker_id == r.policy.order(key)[0]


async def test_a_placement_in_flight_counts_until_reported() -> None:
    eps = [f"tcp://127.0.0.1:{5400 + i}" for i in range(3)]
    r = await replica(eps, "gw")
    for ep in eps:
        r.membership.observe(ep, stats(ep, report(0, [], snapshot=True)))
    prompt = list(range(300, 460))
    key = r.key_for(RouteRequest("x", NS, prompt, 300))
    away = r.policy.order(key)[2]  # not the ring's home
    r.sending.add(key, away, 128)
    r.sending.add(key, away, 128)
    assert r.pick(key, 300, span=128, matched={}).worker_id == away
    r.sending.remove(key, away)
    assert r._candidates(key, frozenset(), {}).held == {away: 128}
    r.sending.remove(key, away)
    assert r.sending.held(key) == {}


async def test_footprints_from_reports_agree_across_replicas() -> None:
    eps = [f"tcp://127.0.0.1:{5500 + i}" for i in range(3)]
    routers = [await replica(eps, "gw-a"), await replica(eps, "gw-b")]
    for r in routers:
        for ep in eps:
            r.membership.observe(ep, stats(ep, report(0, [], snapshot=True)))
        r.membership.observe(eps[0], stats(eps[0], report(1, range(200))))  # 3,200 tokens stored on worker 0
        r.membership.observe(eps[1], stats(eps[1], report(1, range(1000, 1020))))
    a, b = (r._footprints_over_allowance() for r in routers)
    assert a == b and a[eps[0]] > a[eps[1]] == 0.0  # worker 1 stays within its free quarter (1,024 tokens)
    fresh = list(range(7000, 7200))  # a new prefix avoids the worker over its share, on both replicas
    picks = {r.pick(r.key_for(RouteRequest("x", NS, fresh, 300)), 300, span=128).worker_id for r in routers}
    assert len(picks) == 1 and eps[0] not in picks
