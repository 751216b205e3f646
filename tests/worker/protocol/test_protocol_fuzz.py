"""Worker -> gateway frames that are valid msgpack of the right shape but carry wrong types.

Every field of a well-formed `out`, `err` and `stats` frame (and every element of an `out` row) is
replaced in turn by values of other types: decoding either yields records whose fields have their
documented types, or raises ProtocolError, never TypeError, AttributeError or anything else.
"""

from __future__ import annotations

import math

import msgpack
import pytest

from worker import protocol as p

WRONG = [None, True, False, 0, -1, 2**63 - 1, -(2**63), 1.5, math.nan, math.inf, "", "x", b"",
         b"\x01\x02\x03", b"\x00" * 8, [], [1], ["a", b"b"], {}, {"k": 1}]


def out_frame() -> dict:
    return msgpack.unpackb(p.encode_out([p.OutItem("r1", [1, 2], None, 3, [-0.5, -1.5]),
                                         p.OutItem("r2", [7], "stop", 0, None)], 12.5), raw=False)


def err_frame() -> dict:
    return msgpack.unpackb(p.encode_err("r1", p.ErrorCode.CAPACITY, "full", True), raw=False)


def stats_frame() -> dict:
    stats = p.WorkerStats("w", 1, 2, 3, 4, 0.5, False, "m", p.PROTOCOL_VERSION)
    return msgpack.unpackb(p.encode_stats(stats), raw=False)


def variants() -> list[tuple[str, dict]]:
    """(label, frame) for every single-field substitution of a wrong-typed value."""
    out: list[tuple[str, dict]] = []
    for make in (out_frame, err_frame, stats_frame):
        base = make()
        for name in base:
            for value in WRONG:
                frame = make()
                frame[name] = value
                out.append((f"{base['t']}.{name}={value!r}"[:60], frame))
            frame = make()
            del frame[name]
            out.append((f"{base['t']} without {name}", frame))
    for col in range(5):
        for value in WRONG:
            frame = out_frame()
            frame["items"][0][col] = value
            out.append((f"out.items[0][{col}]={value!r}"[:60], frame))
    for rows in ([[]], [["r1"]], [{"rid": "r1"}], ["r1"], [None]):
        frame = out_frame()
        frame["items"] = rows
        out.append((f"out.items={rows!r}", frame))
    frame = out_frame()
    frame["items"][0][4] = p.pack_logprobs([-1.0])  # one logprob for two tokens
    out.append(("out logprobs count differs from tokens", frame))
    return out


def check_types(frame: p.OutFrame | p.ErrFrame | p.WorkerStats) -> None:
    if isinstance(frame, p.OutFrame):
        assert isinstance(frame.sent_at, float)
        for item in frame.items:
            assert isinstance(item.rid, str) and item.rid
            assert isinstance(item.tokens, list) and all(type(t) is int for t in item.tokens)
            assert item.finish_reason is None or isinstance(item.finish_reason, str)
            assert type(item.cached_tokens) is int and item.cached_tokens >= 0
            assert item.logprobs is None or (len(item.logprobs) == len(item.tokens)
                                             and all(isinstance(x, float) for x in item.logprobs))
    elif isinstance(frame, p.ErrFrame):
        assert isinstance(frame.rid, str) and isinstance(frame.code, p.ErrorCode)
        assert isinstance(frame.message, str) and type(frame.retryable) is bool
    else:
        for name in ("queue", "running", "kv_free", "kv_total", "version"):
            assert type(getattr(frame, name)) is int, name
        assert isinstance(frame.worker_id, str) and isinstance(frame.model, str)
        assert type(frame.draining) is bool and isinstance(frame.hit_rate, float)


CASES = variants()


@pytest.mark.parametrize("frame", [f for _, f in CASES], ids=[label for label, _ in CASES])
def test_wrong_types_raise_protocol_error_or_decode_cleanly(frame: dict) -> None:
    data = msgpack.packb(frame, use_bin_type=True)
    try:
        decoded = p.decode_worker_frame(data)
    except p.ProtocolError:
        return
    check_types(decoded)


def test_rids_named_by_a_broken_out_frame() -> None:
    frame = out_frame()
    frame["items"][0][3] = "many"
    frame["items"].append([["not", "a", "rid"], b"", None, 0, None])
    data = msgpack.packb(frame, use_bin_type=True)
    with pytest.raises(p.ProtocolError):
        p.decode_worker_frame(data)
    assert p.rids_in_frame(data) == ["r1", "r2"]
    assert p.rids_in_frame(b"\xc1") == []
    assert p.rids_in_frame(p.encode_err("r9", p.ErrorCode.INTERNAL, "x", True)) == ["r9"]
