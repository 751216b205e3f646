"""Wire protocol codec: round trips, validation of hostile frames, no torch at import time."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker import protocol as p


def test_gen_round_trip_packs_tokens_as_int32_le() -> None:
    sampling = p.SamplingParams(max_tokens=4, temperature=1, seed=7)
    frame = p.encode_gen("r1", b"ns", [1, 2, 70000], sampling, priority=p.Priority.BATCH, deadline=12.5)
    raw = msgpack.unpackb(frame, raw=False)
    assert raw["tokens"] == b"\x01\x00\x00\x00\x02\x00\x00\x00\x70\x11\x01\x00"
    req = p.decode_gateway_frame(frame, max_prompt_tokens=10)
    assert isinstance(req, p.GenRequest)
    assert (req.rid, req.ns, req.priority, req.deadline) == ("r1", b"ns", p.Priority.BATCH, 12.5)
    assert raw["priority"] == 1 and type(raw["priority"]) is int
    assert req.tokens.tolist() == [1, 2, 70000]
    assert req.sampling == {"max_tokens": 4, "temperature": 1, "top_p": 1.0, "top_k": 0, "seed": 7,
                            "stop_token_ids": [], "ignore_eos": False, "logprobs": False}
    assert p.SamplingParams.from_dict(req.sampling) == p.SamplingParams(max_tokens=4, temperature=1.0, seed=7)


def test_hello_and_abort_round_trip() -> None:
    assert p.decode_gateway_frame(p.encode_hello("gw-a"), 8) == p.Hello("gw-a")
    assert p.decode_gateway_frame(p.encode_abort("x"), 8) == p.Abort("x")


def test_out_err_stats_round_trip() -> None:
    items = [p.OutItem("a", [5, 6], None, 3, [-0.5, -1.25]), p.OutItem("b", [], "abort", 0, None)]
    frame = p.encode_out(items, sent_at=123.5)
    rows = [["a", b"\x05\x00\x00\x00\x06\x00\x00\x00", None, 3, np.array([-0.5, -1.25], "<f4").tobytes()],
            ["b", b"", "abort", 0, None]]
    assert msgpack.unpackb(frame, raw=False) == {"t": "out", "items": rows, "ts": 123.5}
    out = p.decode_worker_frame(frame)
    assert out == p.OutFrame([p.OutItem("a", [5, 6], None, 3, [-0.5, -1.25], sent_at=123.5),
                              p.OutItem("b", [], "abort", 0, None, sent_at=123.5)], 123.5)
    err = p.decode_worker_frame(p.encode_err("a", p.ErrorCode.CAPACITY, "draining", True))
    assert err == p.ErrFrame("a", p.ErrorCode.CAPACITY, "draining", True)
    assert msgpack.unpackb(p.encode_err("a", "capacity", "x", True), raw=False)["code"] == "capacity"
    stats = p.WorkerStats("w1", 2, 3, 100, 200, 0.5, False, "m", p.PROTOCOL_VERSION)
    assert p.decode_worker_frame(p.encode_stats(stats)) == stats
    with pytest.raises(ValueError):
        p.encode_err("a", "nope", "x", False)
    with pytest.raises(p.ProtocolError):  # an err frame with an unknown code is malformed
        p.decode_worker_frame(msgpack.packb({"t": "err", "rid": "a", "code": "nope", "message": "",
                                             "retryable": 0}))


def _gen_map(**over: object) -> dict:
    base = {"t": "gen", "rid": "r", "ns": b"", "tokens": p.pack_tokens([1, 2]),
            "sampling": {}, "priority": 0, "deadline": 0.0}
    base.update(over)
    return {k: v for k, v in base.items() if v is not _DROP}


def test_traceparent_rides_only_on_traced_requests() -> None:
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    traced = p.decode_gateway_frame(p.encode_gen("r", b"", [1], p.SamplingParams(), traceparent=tp),
                                    max_prompt_tokens=4)
    assert traced.traceparent == tp
    plain = p.encode_gen("r", b"", [1], p.SamplingParams())
    assert "traceparent" not in msgpack.unpackb(plain, raw=False)
    assert p.decode_gateway_frame(plain, max_prompt_tokens=4).traceparent == ""


_DROP = object()


@pytest.mark.parametrize("over, param", [
    ({"ns": _DROP}, "ns"),
    ({"tokens": _DROP}, "tokens"),
    ({"tokens": [1, 2]}, "tokens"),                      # list instead of packed bytes
    ({"tokens": b"\x01\x00\x00"}, "tokens"),             # not a multiple of 4
    ({"tokens": b""}, "tokens"),
    ({"tokens": p.pack_tokens(range(100))}, "tokens"),   # over the context limit
    ({"sampling": "greedy"}, "sampling"),
    ({"priority": 7}, "priority"),
    ({"priority": True}, "priority"),
    ({"deadline": "soon"}, "deadline"),
    ({"deadline": float("nan")}, "deadline"),
    ({"t": "explode"}, "t"),
    ({"traceparent": "00-abc-def-01"}, "traceparent"),
    ({"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01\n"}, "traceparent"),
    ({"traceparent": 5}, "traceparent"),
])
def test_bad_gen_frames_name_rid_and_param(over: dict, param: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_gateway_frame(msgpack.packb(_gen_map(**over), use_bin_type=True), max_prompt_tokens=64)
    assert info.value.rid == "r"
    assert info.value.param == param


@pytest.mark.parametrize("data", [
    b"\xc1garbage", b"", msgpack.packb([1, 2, 3]), msgpack.packb({"t": "gen"}),
    msgpack.packb({"t": "gen", "rid": 5}), msgpack.packb({"t": "gen", "rid": "x" * 1000}),
    msgpack.packb({"t": "abort"}), msgpack.packb({1: 2}),
])
def test_frames_without_usable_rid_have_no_rid(data: bytes) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_gateway_frame(data, max_prompt_tokens=64)
    assert info.value.rid is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    try:
        p.decode_gateway_frame(data, max_prompt_tokens=64)
    except p.ProtocolError:
        pass
    try:
        p.decode_worker_frame(data)
    except p.ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["t", "rid", "ns", "tokens", "sampling", "priority", "deadline",
                                        "gw"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                                 st.text(max_size=5), st.binary(max_size=12),
                                 st.lists(st.integers(-9, 9), max_size=3),
                                 st.sampled_from(["gen", "abort", "hello"]))))
def test_arbitrary_maps_only_ever_raise_protocol_error(obj: dict) -> None:
    try:
        p.decode_gateway_frame(msgpack.packb(obj, use_bin_type=True), max_prompt_tokens=64)
    except p.ProtocolError:
        pass


def test_protocol_module_does_not_import_torch() -> None:
    code = "import sys, worker.protocol, worker.server.process.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_tokens_view_is_int32() -> None:
    req = p.decode_gateway_frame(p.encode_gen("r", b"", np.arange(5), p.SamplingParams()),
                                 max_prompt_tokens=8)
    assert req.tokens.dtype == np.dtype("<i4")



# The packed `gen` frame of a default request, recorded before the worker's layout change (2026-11-26): the
# wire contract between gateways and workers of different builds must not drift with a refactor.
GOLDEN_GEN = bytes.fromhex(
    "89a174a367656ea3726964a57265712d31a26e73c40974656e616e742d6e73a6746f6b656e73c4100100000002000000"
    "03000000a00f0000a873616d706c696e6788aa6d61785f746f6b656e7310ab74656d7065726174757265cb0000000000"
    "000000a5746f705f70cb3ff0000000000000a5746f705f6b00a473656564c0ae73746f705f746f6b656e5f69647390aa"
    "69676e6f72655f656f73c2a86c6f6770726f6273c2a87072696f7269747900a8646561646c696e65cb00000000000000"
    "00a4666b6579c400a6776569676874cb3ff0000000000000"
)


def test_default_gen_frame_is_byte_identical_to_the_recorded_one() -> None:
    frame = p.encode_gen("req-1", b"tenant-ns", [1, 2, 3, 4000], p.SamplingParams(), p.Priority.INTERACTIVE)
    assert frame == GOLDEN_GEN
