"""PrefixHolders: which worker holds which prefix, bounded memory, footprints that follow the working set."""

from __future__ import annotations

import math

import pytest

import router.placement.holders
from router.placement.holders import PrefixHolders


def test_remembers_per_worker_spans() -> None:
    h = PrefixHolders()
    key, other = b"k" * 16, b"o" * 16
    assert h.expected_cached("w", key) == 0 and h.expected_cached("w", None) == 0
    h.remember("w", key, 592)
    h.remember("w", None, 592)  # keyless requests are not remembered
    assert (h.expected_cached("w", key), h.expected_cached("v", key),
            h.expected_cached("w", other)) == (592, 0, 0)


def test_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router.placement.holders, "HIT_MEMORY", 3)
    h = PrefixHolders()
    for i in range(5):
        h.remember("w", bytes([i]) * 16, 100)
    assert [h.expected_cached("w", bytes([i]) * 16) for i in range(5)] == [0, 0, 100, 100, 100]
    assert h.footprints() == {"w": 300}  # the dropped keys no longer count


def test_footprints_follow_remember_forget_and_clear() -> None:
    h = PrefixHolders()  # no capacities known: no decay
    a, b = b"a" * 16, b"b" * 16
    h.remember("w", a, 64)
    h.remember("w", a, 96)  # a larger reported hit replaces the span, it does not add to it
    h.remember("w", b, 32)
    h.remember("v", a, 64)
    assert h.footprints() == {"w": 128, "v": 64}
    h.forget("v")
    assert h.footprints() == {"w": 128} and h.expected_cached("v", a) == 0
    h.clear()
    assert h.footprints() == {} and h.expected_cached("w", a) == 0


def test_an_unused_prefix_fades_as_new_prefixes_come_in() -> None:
    """Weight exp(-placed since last use / cluster KV tokens): the footprint tracks the working set."""
    h = PrefixHolders()
    h.set_capacity("w", 600)
    h.set_capacity("v", 400)  # the scale: 1,000 KV tokens in the cluster
    old, hot = b"o" * 16, b"h" * 16
    h.remember("w", old, 100)
    h.remember("w", hot, 100)
    for i in range(5):  # 500 new prefix tokens placed on v; w's hot prefix is used again each time
        h.remember("v", bytes([i]) * 16, 100)
        h.remember("w", hot, 100)
    assert h.footprints()["w"] == pytest.approx(100 * math.exp(-600 / 1000) + 100)
    assert h.footprints()["v"] == pytest.approx(sum(100 * math.exp(-100 * k / 1000) for k in range(5)))
    assert h.capacity("w") == 600
    h.forget("v")  # its capacity leaves the scale too
    assert h.capacity("v") == 0
