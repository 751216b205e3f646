"""TTFT deadlines and step costs on the wire: the `gen` frame's `ttft` (absent when none; an older frame
reads as none; a bad value is refused naming it) and the stats frame's measured costs (an older worker's
frame reads as unknown, 0)."""

from __future__ import annotations

import msgpack
import pytest

from worker import protocol as p


def test_gen_frame_carries_the_ttft_deadline_only_when_set():
    plain = p.encode_gen("r", b"ns", [1, 2], p.SamplingParams())
    assert "ttft" not in msgpack.unpackb(plain)
    assert p.decode_gateway_frame(plain, 8).ttft_deadline == 0.0
    frame = p.encode_gen("r", b"ns", [1, 2], p.SamplingParams(), ttft_deadline=1234.5)
    assert p.decode_gateway_frame(frame, 8).ttft_deadline == 1234.5
    bad = msgpack.unpackb(frame)
    bad["ttft"] = -1.0
    with pytest.raises(p.ProtocolError) as exc:
        p.decode_gateway_frame(msgpack.packb(bad), 8)
    assert exc.value.param == "ttft"


def test_stats_costs_round_trip_and_an_older_frame_reads_as_unknown():
    stats = p.WorkerStats("w", 1, 2, 100, 200, 0.5, False, "m", p.PROTOCOL_VERSION, prefill_tps=5000.0,
                          step_s=0.02, prefill_backlog=300)
    assert p.decode_worker_frame(p.encode_stats(stats)) == stats
    old = msgpack.unpackb(p.encode_stats(stats))
    for name in ("ptps", "step", "pback"):
        del old[name]
    got = p.decode_worker_frame(msgpack.packb(old))
    assert (got.prefill_tps, got.step_s, got.prefill_backlog) == (0.0, 0.0, 0)
    old["ptps"] = "fast"  # malformed: unknown, the rest of the frame still read
    assert p.decode_worker_frame(msgpack.packb(old)).prefill_tps == 0.0
