"""vLLM's KV event records: the array shape vLLM's msgspec structs and llm-d read, the map shape, unknown
and malformed events reported rather than fatal, and block hashes as 64-bit ids."""

from __future__ import annotations

import msgspec
import pytest

from worker.protocol.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    hash_id,
)


def test_encodes_as_vllm_tagged_arrays_and_decodes_back() -> None:
    batch = KVEventBatch(1.5, [BlockStored([1, 2], None, [5] * 8, 4, None, "GPU"), BlockRemoved([3], "CPU"),
                               AllBlocksCleared()], 0)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0][:7] == ["BlockStored", [1, 2], None, [5] * 8, 4, None, "GPU"]
    assert raw[1][1][:3] == ["BlockRemoved", [3], "CPU"] and raw[1][2] == ["AllBlocksCleared"]
    _, events, bad = decode_batch(encode_batch(batch))
    assert events == batch.events and bad == []


def test_map_encoded_batches_and_older_shorter_events_decode() -> None:
    payload = msgspec.msgpack.encode({"ts": 2.0, "events": [
        {"type": "BlockStored", "block_hashes": [b"\x00" * 24 + (7).to_bytes(8, "big")],
         "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2, "lora_id": None},
        ["BlockRemoved", [9]]]})  # an older vLLM: no medium
    _, events, bad = decode_batch(payload)
    assert bad == [] and hash_id(events[0].block_hashes[0]) == 7
    assert events[1] == BlockRemoved([9], None)


def test_unknown_and_malformed_events_are_reported_not_fatal() -> None:
    payload = msgspec.msgpack.encode([0.0, [["NewKind", 1], ["BlockStored", "x"], 5, ["AllBlocksCleared"]]])
    _, events, bad = decode_batch(payload)
    assert events == [AllBlocksCleared()] and bad == ["NewKind", "BlockStored(malformed)", "?"]
    with pytest.raises(ValueError):
        decode_batch(b"\xc1")
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode([0.0]))


def test_seq_and_hash_conversions() -> None:
    assert encode_seq(5) == (5).to_bytes(8, "big") and decode_seq(encode_seq(-1)) == -1
    with pytest.raises(ValueError):
        decode_seq(b"\x00")
    assert hash_id(-1) == 2**64 - 1 and hash_id(b"\x01\x02") == 0x0102
