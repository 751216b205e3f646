"""What a worker reports about itself: the `stats` frame, its kv handshake and block-id batches, and the
gateway's `sync` (send me a snapshot). Private to `worker.protocol`, which re-exports every name; import them
from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

STATS = "stats"
SYNC = "sync"
BLOCK_ID_DTYPE = np.dtype("<u8")
MAX_KV_IDS = 2_000_000  # per list in one frame (16 MB packed)
MAX_KV_TEXT = 128


@dataclass(slots=True, frozen=True)
class KvContract:
    """What must match for a gateway's block hashes to name a worker's blocks: the handshake of `stats.kv`."""

    block_size: int
    hash_algo: str  # worker.block_hash.HASH_ALGO
    tokenizer: str  # the worker's tokenizer version


@dataclass(slots=True)
class KvReport:
    """A batch of block ids a worker stored and evicted (`snapshot`: `stored` is all it holds), numbered
    `seq` within the worker process's `epoch`."""

    contract: KvContract
    epoch: int
    seq: int
    snapshot: bool
    stored: list[int]
    evicted: list[int]
    # blocks entering and leaving the worker's KV tiers below memory (snapshot: `tiered` is all a tier holds);
    # on the wire as "tadd"/"tdel" only when non-empty, so an older gateway reads the rest as before
    tiered: list[int] = field(default_factory=list)
    untiered: list[int] = field(default_factory=list)


@dataclass(slots=True)
class WorkerStats:
    worker_id: str
    queue: int
    running: int
    kv_free: int
    kv_total: int
    hit_rate: float
    draining: bool
    model: str
    version: int
    received_at: float = 0.0  # time.monotonic() at the receiver; not on the wire
    kv: KvReport | None = None  # None: the worker reports no blocks (no prefix cache, or an older worker)
    # why the frame's `kv` part could not be read (the rest of the frame could); not on the wire
    kv_error: str = ""
    role: str = "both"  # disaggregation role; on the wire as "role" only when not "both"
    # measured step costs (TTFT prediction in admission); absent from an older worker's frame: 0.0 (unknown)
    prefill_tps: float = 0.0  # prompt tokens a second in steps that prefill ("ptps")
    step_s: float = 0.0  # seconds one engine step takes ("step")
    prefill_backlog: int = 0  # prompt tokens waiting or mid-prefill, not yet computed ("pback")


@dataclass(slots=True)
class Sync:
    """gw -> worker: send this gateway a stats frame with a full block snapshot."""


def pack_block_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=BLOCK_ID_DTYPE).tobytes()


def kv_fields(kv: KvReport) -> dict[str, Any]:
    c = kv.contract
    return {"bs": c.block_size, "hash": c.hash_algo, "tok": c.tokenizer, "ep": kv.epoch, "seq": kv.seq,
            "snap": kv.snapshot, "add": pack_block_ids(kv.stored), "del": pack_block_ids(kv.evicted),
            **({"tadd": pack_block_ids(kv.tiered)} if kv.tiered else {}),
            **({"tdel": pack_block_ids(kv.untiered)} if kv.untiered else {})}


def stats_fields(stats: WorkerStats) -> dict[str, Any]:
    obj = {"t": STATS, "worker_id": stats.worker_id, "queue": stats.queue, "running": stats.running,
           "kv_free": stats.kv_free, "kv_total": stats.kv_total, "hit_rate": stats.hit_rate,
           "draining": stats.draining, "model": stats.model, "version": stats.version}
    if stats.kv is not None:
        obj["kv"] = kv_fields(stats.kv)
    if stats.role != "both":
        obj["role"] = stats.role
    obj.update(ptps=float(stats.prefill_tps), step=float(stats.step_s), pback=int(stats.prefill_backlog))
    return obj


def decode_costs(obj: dict[str, Any], stats: WorkerStats) -> None:
    """The step-cost fields of a stats frame into `stats`; an absent or malformed one stays 0 (unknown)."""
    for wire, name, kind in (("ptps", "prefill_tps", float), ("step", "step_s", float),
                             ("pback", "prefill_backlog", int)):
        value = obj.get(wire)
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < float("inf"):
            setattr(stats, name, kind(value))


def _ids(raw: Any, name: str) -> list[int]:
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise ValueError(f"kv.{name} is not packed uint64")
    if len(raw) // 8 > MAX_KV_IDS:
        raise ValueError(f"kv.{name} holds over {MAX_KV_IDS} ids")
    return np.frombuffer(raw, dtype=BLOCK_ID_DTYPE).tolist()


def _int(obj: dict[str, Any], name: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"kv.{name} is not a non-negative int")
    return value


def _text(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or len(value) > MAX_KV_TEXT:
        raise ValueError(f"kv.{name} is not a short string")
    return value


def decode_kv(obj: Any) -> KvReport:
    """The `kv` part of a stats frame; ValueError names what is wrong (the caller keeps the rest of the
    frame)."""
    if not isinstance(obj, dict):
        raise ValueError("kv is not a map")
    snap = obj.get("snap")
    if not isinstance(snap, bool):
        raise ValueError("kv.snap is not a bool")
    contract = KvContract(_int(obj, "bs"), _text(obj, "hash"), _text(obj, "tok"))
    tiered = _ids(obj["tadd"], "tadd") if "tadd" in obj else []  # absent: a worker without tiers (or older)
    untiered = _ids(obj["tdel"], "tdel") if "tdel" in obj else []
    return KvReport(contract, _int(obj, "ep"), _int(obj, "seq"), snap, _ids(obj.get("add"), "add"),
                    _ids(obj.get("del"), "del"), tiered, untiered)
