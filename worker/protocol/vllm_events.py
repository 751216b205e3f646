"""vLLM's KV event format (a KVEventBatch per ZeroMQ PUB message), shared by the worker's publisher and the
router's subscriber.

A PUB message is three frames: topic, the batch's sequence number (8 bytes, big-endian, from 0) and the
msgpack payload. A replay request on the ROUTER socket is the 8-byte first wanted number; the answer is one
(seq, payload) message per buffered batch from there, then (`REPLAY_END`, b""). Events are tagged arrays as
msgspec encodes vLLM's `array_like` structs: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, ...]``; the batch is ``[ts, events, data_parallel_rank]``. Batches
encoded as maps (``{"type": "BlockStored", ...}``) decode too; trailing fields this module does not know are
ignored, unknown event tags are counted by the caller.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for device memory (a None medium means the same)
MEDIUM_CPU = "CPU"  # vLLM's CPU offloading tier; Switchyard's host-RAM tier
MEDIUM_DISK = "DISK"  # Switchyard's disk tier (llm-d lower-cases it into its device tier "disk")
SEQ_BYTES = 8
REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MAX_PAYLOAD_BYTES = 64 << 20


class BlockStored(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Blocks now held on `medium`: `block_hashes` in chain order, the first one's parent
    `parent_block_hash` (None: the prompt's first block), their `token_ids` (block_size per block)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # per block: what else vLLM hashed (LoRA name, multimodal ids, the first block's cache_salt)
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Blocks no longer held on `medium`."""

    block_hashes: list[int | bytes]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Everything the publisher held is gone (a Switchyard worker follows it with what it holds now)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TAGS = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]  # KvEvent on the way out; raw (decoded one by one) on the way in
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_raw = msgspec.msgpack.Decoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(raw: bytes) -> int:
    if len(raw) != SEQ_BYTES:
        raise ValueError(f"a sequence number is {SEQ_BYTES} bytes, not {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def decode_batch(payload: bytes) -> tuple[KVEventBatch, list[KvEvent], list[str]]:
    """The batch, its events and the tags of the events it could not read (unknown or malformed: the caller
    counts them). ValueError when the batch itself cannot be read."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload over {MAX_PAYLOAD_BYTES} bytes")
    try:
        obj = _raw.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(obj, dict):
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError("not a KVEventBatch (want [ts, events, ...])")
    try:
        batch = msgspec.convert(obj[:3], KVEventBatch)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad KVEventBatch: {exc}") from None
    events: list[KvEvent] = []
    bad: list[str] = []
    for raw in batch.events:
        event, tag = _event(raw)
        if event is None:
            bad.append(tag)
        else:
            events.append(event)
    return batch, events, bad


def _event(raw: Any) -> tuple[KvEvent | None, str]:
    if isinstance(raw, dict):  # map-encoded: put its fields in declaration order
        tag = raw.get("type")
        cls = EVENT_TAGS.get(tag) if isinstance(tag, str) else None
        if cls is None:
            return None, str(tag)[:64]
        raw = [tag, *(raw.get(name) for name in cls.__struct_fields__)]
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        return None, "?"
    cls = EVENT_TAGS.get(raw[0])
    if cls is None:
        return None, raw[0][:64]
    try:
        return msgspec.convert(raw[: 1 + len(cls.__struct_fields__)], cls), raw[0]
    except msgspec.ValidationError:
        return None, f"{raw[0]}(malformed)"


def hash_id(h: int | bytes) -> int:
    """A block hash as a 64-bit id: an int modulo 2**64; bytes by their last 8, big-endian (as llm-d reads
    vLLM's sha256 hashes)."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & 0xFFFF_FFFF_FFFF_FFFF
