"""Model pools in the router: the Fleet's split of workers by model version, aliases (weights, stickiness,
fallback, live edits) and traffic-class pool preference with spill, on simulated workers (no sockets)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from bench.fleet import SimMembership, sim_fleet
from common.priorities import Priority
from common.worker_registry import Registration, encode_registration, parse_registration
from router import (
    Alias,
    AliasTable,
    Fleet,
    Router,
    RouteRequest,
    Served,
    encode_alias,
    namespace_root,
    parse_alias,
    sticky_key,
)
from worker.protocol import PROTOCOL_VERSION


def test_registration_carries_what_the_worker_serves_and_old_records_parse() -> None:
    reg = Registration("w", "tcp://h:1", "m", PROTOCOL_VERSION, 1.0, model_version="v2", tokenizer="ab",
                       spec="default", pool="batch")
    assert parse_registration(encode_registration(reg)) == reg
    old = parse_registration('{"worker_id": "w", "endpoint": "e", "model": "m", '
                             '"version": 1, "started_at": 0}')
    assert (old.model_version, old.pool, old.spec, old.tokenizer) == ("", "", "", "")
    with pytest.raises(ValueError, match="pool"):
        parse_registration('{"worker_id": "w", "endpoint": "e", "model": "m", "version": 1, "started_at": 0, '
                           '"pool": 7}')
    assert Served.of(reg).key == "m@v2" and Served("m").key == "m"


def test_fleet_gives_each_version_its_own_router_over_its_workers() -> None:
    fleet, m = sim_fleet({"m@v1": ["a", "b"], "m@v2": ["c"], "other": ["d"]})
    assert fleet.versions() == ["m@v1", "m@v2", "other"]
    assert fleet.versions_of("m") == ["m@v1", "m@v2"]
    v1, v2 = fleet.router("m@v1"), fleet.router("m@v2")
    assert v1 is not None and v2 is not None and v1 is not v2
    assert v1.live() == ["a", "b"] and v2.live() == ["c"]
    assert v1.policy.members == {"a", "b"}
    m.kill("c")
    assert fleet.live_versions() == ["m@v1", "other"]
    m.remove("a")
    assert v1.live() == ["b"] and v1.policy.members == {"b"}


def test_static_workers_serve_the_default_model() -> None:
    m = SimMembership()
    fleet = Fleet(m, lambda view, served: Router(view, secret=b"s"),
                  default=Served("own"))  # type: ignore[arg-type]
    m.add("x", "whatever")
    m.member("x").registration = None  # type: ignore[union-attr]  # as a static endpoint has none
    m.add("y", "whatever")
    m.member("y").registration = None  # type: ignore[union-attr]
    m.remove("x")
    m.add("x", "m", "v9")
    assert fleet.router("m@v9").live() == ["x"]  # type: ignore[union-attr]
    assert fleet.versions() == ["m@v9", "whatever"]


def _shares(alias: Alias, live: set[str], n: int, salt: str = "") -> dict[str, float]:
    picks = [alias.pick(live, sticky_key(f"t{i % 5}", alias.name, f"conv-{i}{salt}")) for i in range(n)]
    return {k: picks.count(k) / n for k in set(picks)}


def test_alias_weights_hold_within_tolerance_and_choices_stick() -> None:
    alias = parse_alias("default", encode_alias({"m@v1": 90, "m@v2": 10}))
    shares = _shares(alias, {"m@v1", "m@v2"}, 4000)
    assert abs(shares["m@v2"] - 0.10) < 0.02
    key = sticky_key("t", "default", "conv")
    assert len({alias.pick({"m@v1", "m@v2"}, key) for _ in range(20)}) == 1
    # a weight change moves only the keys of the share that moved (cumulative buckets)
    moved = parse_alias("default", encode_alias({"m@v1": 80, "m@v2": 20}))
    keys = [sticky_key("t", "default", f"c{i}") for i in range(2000)]
    changed = sum(alias.pick({"m@v1", "m@v2"}, k) != moved.pick({"m@v1", "m@v2"}, k) for k in keys)
    assert changed / len(keys) < 0.13


def test_broken_alias_falls_back_to_live_versions_and_none_live_gives_none() -> None:
    alias = Alias("default", (("m@v1", 90.0), ("m@v2", 10.0), ("m@v3", 0.0)))
    assert set(_shares(alias, {"m@v2"}, 200)) == {"m@v2"}
    assert set(_shares(alias, {"m@v3"}, 50)) == {"m@v3"}  # only a weight-0 version left: better than a 503
    assert alias.pick(set(), b"k") is None


@pytest.mark.parametrize("raw", ["not json", "[]", "{}", '{"a": -1}', '{"a": 0}', '{"a": "x"}', '{"a": true}',
                                 '{"a": NaN}'])
def test_malformed_alias_records_are_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_alias("default", raw)


class FakeRedis:
    def __init__(self) -> None:
        self.records: dict[bytes, bytes] = {}
        self.fail = False

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        if self.fail:
            raise ConnectionError("redis down")
        return dict(self.records)


def test_alias_table_keeps_the_last_good_record(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        r = FakeRedis()
        table = AliasTable(r, poll_s=0.01)
        r.records[b"default"] = encode_alias({"m@v1": 90, "m@v2": 10}).encode()
        await table.start()
        assert dict(table.get("default").targets) == {"m@v1": 90.0, "m@v2": 10.0}  # type: ignore[union-attr]
        r.records[b"default"] = b'{"m@v1": "lots"}'
        await asyncio.sleep(0.05)
        assert dict(table.get("default").targets) == {"m@v1": 90.0, "m@v2": 10.0}  # type: ignore[union-attr]
        r.records[b"default"] = encode_alias({"m@v1": 50, "m@v2": 50}).encode()
        await asyncio.sleep(0.05)  # an edit applies within a poll
        assert dict(table.get("default").targets) == {"m@v1": 50.0, "m@v2": 50.0}  # type: ignore[union-attr]
        r.fail = True
        await asyncio.sleep(0.05)
        assert table.get("default") is not None  # Redis down: the aliases in force stay
        r.fail = False
        r.records.clear()
        await asyncio.sleep(0.05)
        assert table.get("default") is None and table.names() == []
        await table.close()

    with caplog.at_level(logging.WARNING, logger="router.pools.alias_table"):
        asyncio.run(main())
    assert sum("malformed alias record default" in r.getMessage() for r in caplog.records) == 1


def test_a_priority_class_prefers_its_pool_and_spills_under_load() -> None:
    m = SimMembership()
    router = Router(m, secret=b"s",
                    class_pools={Priority.BATCH: "batch",
                                 Priority.INTERACTIVE: "interactive"})  # type: ignore[arg-type]
    for w, pool in (("i1", "interactive"), ("i2", "interactive"), ("b1", "batch")):
        m.add(w, "m", pool=pool)
    ns = namespace_root("m", "v", "t", b"s")
    req = RouteRequest("r", ns, list(range(64)), 100, stable_len=64, priority=Priority.BATCH)
    key = router.key_for(req)
    assert router._pick_in_class(key, req, frozenset(), 64, {}).worker_id == "b1"
    inter = RouteRequest("r2", ns, list(range(64)), 100, stable_len=64)
    assert router._pick_in_class(key, inter, frozenset(), 64, {}).worker_id in ("i1", "i2")
    router.loads.add("b1", "busy", 10_000, 0.0)  # the batch pool is far over the mean: batch spills
    assert router._pick_in_class(key, req, frozenset(), 64, {}).worker_id in ("i1", "i2")
    m.kill("b1")
    assert router._pick_in_class(key, req, frozenset(), 64, {}).worker_id in ("i1", "i2")


def test_past_the_version_bound_an_idle_version_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    import router.fleet

    monkeypatch.setattr(router.fleet, "MAX_VERSIONS", 2)
    fleet, m = sim_fleet({"m@v1": ["a"], "m@v2": ["b"]})
    m.add("c", "m", "v3")
    assert fleet.versions() == ["m@v1", "m@v2"]  # full, and both versions have workers
    m.remove("a")
    m.remove("c")
    m.add("c", "m", "v3")
    assert fleet.versions() == ["m@v2", "m@v3"] and fleet.router("m@v3").live() == ["c"]  # type: ignore[union-attr]


def test_bench_fleet_meets_the_targets() -> None:
    from bench.fleet import run

    result = run(2000, 7, {"m@v1": 90.0, "m@v2": 10.0})
    assert result["hit_ratio_vs_single_model"] >= 0.95
    assert result["weight_error"] <= 0.03
    assert result["sticky_frac"] == 1.0
    assert result["moved_frac_least"] == 0.4  # 90/10 -> 50/50: 0.4 of the share must move
    assert 0.4 <= result["moved_frac"] <= 0.45  # a weighted rendezvous pick moves about that, not half
    assert all(result["met"].values())
