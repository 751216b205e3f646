"""The gateway <-> worker frames: msgpack over ZeroMQ and their typed records, which both ends encode and
decode here; no torch (the package face re-exports them with the block-hash, grammar and registry names)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from common.priorities import MAX_WEIGHT, Priority
from common.trace_context import valid_traceparent
from common.worker_registry import ROLES
from worker.protocol.request import ErrorCode, SamplingParams
from worker.protocol.request import RequestError as RequestError
from worker.protocol.request import bad_request as bad_request
from worker.protocol.stats import MAX_KV_IDS as MAX_KV_IDS
from worker.protocol.stats import STATS, SYNC, Sync, WorkerStats, decode_costs, decode_kv, stats_fields
from worker.protocol.stats import KvContract as KvContract
from worker.protocol.stats import KvReport as KvReport
from worker.protocol.transfer import (
    PF,
    PF_ABORT,
    PrefillAbort,
    PrefillHint,
    PrefillRequest,
    decode_hint,
    decode_prefill,
    hint_field,
)

PROTOCOL_VERSION = 1

HELLO = "hello"
GEN = "gen"
ABORT = "abort"
OUT = "out"
ERR = "err"

MAX_RID_LEN = 256
MAX_NS_LEN = 1024
MAX_GATEWAY_ID_LEN = 256
MAX_FKEY_LEN = 64  # `gen.fkey`: opaque fairness key
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MAX_FINISH_LEN = 64


class ProtocolError(ValueError):
    """A frame that breaks the protocol. `rid` is set when the frame named a usable request id."""

    def __init__(self, message: str, rid: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.rid = rid
        self.param = param


@dataclass(slots=True)
class Hello:
    gw: str


@dataclass(slots=True)
class GenRequest:
    rid: str
    ns: bytes
    tokens: np.ndarray  # int32, read-only view over the frame
    sampling: dict[str, Any]  # the worker builds SamplingParams.from_dict() from it
    priority: Priority
    deadline: float  # unix seconds; 0.0 = no deadline
    fkey: bytes = b""  # fairness key (opaque); empty: the worker uses `ns`
    weight: float = 1.0  # fair-share weight
    resumed: int = 0  # the last `resumed` tokens were already streamed by another worker: output, not prompt
    traceparent: str = ""  # W3C trace context of the gateway's span for this request ("" : not traced)
    prefill: PrefillHint | None = None  # disaggregated: prefill on that worker and receive the pages
    ttft_deadline: float = 0.0  # unix seconds the first token is due by ("ttft"); 0.0 = no TTFT target


@dataclass(slots=True)
class Abort:
    rid: str


@dataclass(slots=True)
class OutItem:
    """One request's new tokens in an `out` frame (tokens and logprobs travel packed)."""

    rid: str
    tokens: list[int]
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[float] | None
    sent_at: float = 0.0  # the frame's `ts`, copied into each item on decode (hop-latency metrics)
    top_ids: list[list[int]] | None = None  # per token, the k most likely ids (`top_logprobs`)
    top_logprobs: list[list[float]] | None = None


@dataclass(slots=True)
class OutFrame:
    items: list[OutItem]
    sent_at: float  # worker's time.time() when it sent the frame; 0.0 when absent


@dataclass(slots=True)
class ErrFrame:
    rid: str
    code: ErrorCode
    message: str
    retryable: bool


# ---------------------------------------------------------------- packing helpers

def pack_tokens(tokens: Any) -> bytes:
    """Token ids (list, array or ndarray) -> int32 little-endian bytes."""
    return np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes()


def pack_logprobs(values: Any) -> bytes:
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ---------------------------------------------------------------- encoders

def encode_hello(gateway_id: str) -> bytes:
    return _pack({"t": HELLO, "gw": gateway_id})


def encode_gen(rid: str, ns: bytes, tokens: Any, sampling: SamplingParams,
               priority: Priority = Priority.INTERACTIVE, deadline: float = 0.0, fkey: bytes = b"",
               weight: float = 1.0, resumed: int = 0, traceparent: str = "",
               prefill: PrefillHint | None = None, ttft_deadline: float = 0.0) -> bytes:
    token_bytes = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    obj = {"t": GEN, "rid": rid, "ns": bytes(ns), "tokens": token_bytes, "sampling": sampling.to_dict(),
           "priority": int(priority), "deadline": float(deadline), "fkey": bytes(fkey),
           "weight": float(weight)}
    if resumed:  # only a resumed stream carries it: a fresh request's frame is unchanged
        obj["resumed"] = int(resumed)
    if traceparent:  # only a traced request carries it
        obj["traceparent"] = traceparent
    if prefill is not None:  # only a disaggregated request carries it
        obj["prefill"] = hint_field(prefill)
    if ttft_deadline > 0:  # only a request with a TTFT target carries it
        obj["ttft"] = float(ttft_deadline)
    return _pack(obj)


def _pack_top(item: OutItem) -> list:
    """The optional 6th out-row element: [k, packed ids, packed logprobs], row-major per token."""
    if item.top_ids is None or item.top_logprobs is None:
        return []
    k = len(item.top_ids[0]) if item.top_ids else 0
    flat_ids = [t for row in item.top_ids for t in row]
    flat_lps = [v for row in item.top_logprobs for v in row]
    return [[k, pack_tokens(flat_ids), pack_logprobs(flat_lps)]]


def _unpack_top(top: Any, n_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    if not isinstance(top, list) or len(top) != 3 or not isinstance(top[0], int):
        raise ProtocolError("out item top logprobs are not [k, ids, logprobs]")
    k, ids_raw, lps_raw = top
    ids = np.frombuffer(ids_raw, dtype=TOKEN_DTYPE)
    lps = np.frombuffer(lps_raw, dtype=LOGPROB_DTYPE)
    if k < 0 or len(ids) != k * n_tokens or len(lps) != len(ids):
        raise ProtocolError("out item top logprobs have the wrong size")
    return ids.reshape(n_tokens, k).tolist(), lps.reshape(n_tokens, k).tolist()


def encode_abort(rid: str) -> bytes:
    return _pack({"t": ABORT, "rid": rid})


def encode_out(items: list[OutItem], sent_at: float = 0.0) -> bytes:
    rows = [[i.rid, pack_tokens(i.tokens), i.finish_reason, i.cached_tokens,
             None if i.logprobs is None else pack_logprobs(i.logprobs), *_pack_top(i)] for i in items]
    return _pack({"t": OUT, "items": rows, "ts": sent_at})


def encode_err(rid: str, code: ErrorCode | str, message: str, retryable: bool) -> bytes:
    try:
        code = ErrorCode(code)
    except ValueError:
        raise ValueError(f"unknown error code {code!r}") from None
    return _pack({"t": ERR, "rid": rid, "code": code.value, "message": message, "retryable": bool(retryable)})


def encode_stats(stats: WorkerStats) -> bytes:
    return _pack(stats_fields(stats))


def encode_sync() -> bytes:
    return _pack({"t": SYNC})


# ---------------------------------------------------------------- decoding and validation

def _load_map(data: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"frame is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a msgpack map")
    return obj


def _field(obj: dict[str, Any], name: str, kinds: type | tuple[type, ...], rid: str | None) -> Any:
    if name not in obj:
        raise ProtocolError(f"missing field {name!r}", rid=rid, param=name)
    value = obj[name]
    # bool is an int subclass: never accept it where a number is wanted
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise ProtocolError(f"field {name!r} has the wrong type", rid=rid, param=name)
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _usable_rid(obj: dict[str, Any]) -> str | None:
    rid = obj.get("rid")
    if isinstance(rid, str) and 0 < len(rid) <= MAX_RID_LEN:
        return rid
    return None


def _decode_gen(obj: dict[str, Any], max_prompt_tokens: int) -> GenRequest:
    rid = _usable_rid(obj)
    if rid is None:
        raise ProtocolError(f"field 'rid' must be a non-empty string of at most {MAX_RID_LEN} chars",
                            param="rid")
    ns = _field(obj, "ns", bytes, rid)
    if len(ns) > MAX_NS_LEN:
        raise ProtocolError(f"namespace longer than {MAX_NS_LEN} bytes", rid=rid, param="ns")
    raw = _field(obj, "tokens", bytes, rid)
    if len(raw) % 4:
        raise ProtocolError("token bytes length is not a multiple of 4", rid=rid, param="tokens")
    n = len(raw) // 4
    if n == 0:
        raise ProtocolError("prompt has no tokens", rid=rid, param="tokens")
    if n > max_prompt_tokens:
        raise ProtocolError(f"prompt has {n} tokens, over the limit of {max_prompt_tokens}",
                            rid=rid, param="tokens")
    tokens = np.frombuffer(raw, dtype=TOKEN_DTYPE)
    sampling = _field(obj, "sampling", dict, rid)
    priority = _field(obj, "priority", int, rid)
    if priority not in (0, 1):
        raise ProtocolError("priority must be 0 (interactive) or 1 (batch)", rid=rid, param="priority")
    deadline = float(_field(obj, "deadline", (int, float), rid))
    ttft = float(_field(obj, "ttft", (int, float), rid)) if "ttft" in obj else 0.0
    for name, value in (("deadline", deadline), ("ttft", ttft)):
        if not math.isfinite(value) or value < 0:
            raise ProtocolError(f"{name} must be a finite non-negative unix time", rid=rid, param=name)
    fkey = _field(obj, "fkey", bytes, rid) if "fkey" in obj else b""
    if len(fkey) > MAX_FKEY_LEN:
        raise ProtocolError(f"fkey longer than {MAX_FKEY_LEN} bytes", rid=rid, param="fkey")
    weight = float(_field(obj, "weight", (int, float), rid)) if "weight" in obj else 1.0
    if not 0 < weight <= MAX_WEIGHT:  # also refuses nan
        raise ProtocolError(f"weight must be a finite number in (0, {MAX_WEIGHT:g}]", rid=rid, param="weight")
    resumed = _field(obj, "resumed", int, rid) if "resumed" in obj else 0
    if not 0 <= resumed < n:
        raise ProtocolError("resumed must count fewer tokens than the request carries", rid=rid,
                            param="resumed")
    traceparent = _field(obj, "traceparent", str, rid) if "traceparent" in obj else ""
    if traceparent and not valid_traceparent(traceparent):
        raise ProtocolError("traceparent must be a W3C version-00 trace context", rid=rid,
                            param="traceparent")
    try:
        prefill = decode_hint(obj["prefill"], rid) if "prefill" in obj else None
    except ValueError as exc:
        raise ProtocolError(str(exc), rid=rid, param="prefill") from None
    return GenRequest(rid=rid, ns=ns, tokens=tokens, sampling=sampling, priority=Priority(priority),
                      deadline=deadline, fkey=fkey, weight=weight, resumed=resumed, traceparent=traceparent,
                      prefill=prefill, ttft_deadline=ttft)


def decode_gateway_frame(data: bytes, max_prompt_tokens: int
                         ) -> Hello | GenRequest | Abort | Sync | PrefillRequest | PrefillAbort:
    """Decode a frame to a worker's port (a gateway's, or a decode worker's `pf`). Raises ProtocolError (with
    `.rid` when usable) on anything invalid, TransferFrameError for a bad `pf`.

    `max_prompt_tokens` bounds the prompt length (the model context).
    """
    obj = _load_map(data)
    kind = obj.get("t")
    if kind in (PF, PF_ABORT):
        return decode_prefill(obj, max_prompt_tokens)
    if kind == GEN:
        return _decode_gen(obj, max_prompt_tokens)
    if kind == ABORT:
        rid = _usable_rid(obj)
        if rid is None:
            raise ProtocolError("abort without a usable 'rid'", param="rid")
        return Abort(rid)
    if kind == HELLO:
        gw = obj.get("gw")
        if not isinstance(gw, str) or len(gw) > MAX_GATEWAY_ID_LEN:
            raise ProtocolError("hello without a usable 'gw'", param="gw")
        return Hello(gw)
    if kind == SYNC:
        return Sync()
    raise ProtocolError(f"unknown frame type {kind!r}"[:80], rid=_usable_rid(obj), param="t")


def _out_item(row: list[Any], sent_at: float) -> OutItem:
    """One out row's first five elements, type-checked; ProtocolError names the row's rid when it has one."""
    rid, toks, finish, cached, lps = row[:5]
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_LEN:
        raise ProtocolError("out item without a usable rid")
    if not isinstance(toks, bytes) or len(toks) % 4:
        raise ProtocolError("out item tokens are not packed int32", rid=rid)
    if finish is not None and (not isinstance(finish, str) or len(finish) > MAX_FINISH_LEN):
        raise ProtocolError("out item finish reason is not a short string", rid=rid)
    if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
        raise ProtocolError("out item cached_tokens is not a non-negative int", rid=rid)
    if lps is not None and (not isinstance(lps, bytes) or len(lps) != len(toks)):
        raise ProtocolError("out item logprobs are not one packed float32 per token", rid=rid)
    return OutItem(rid=rid, tokens=np.frombuffer(toks, dtype=TOKEN_DTYPE).tolist(), finish_reason=finish,
                   cached_tokens=cached, sent_at=sent_at,
                   logprobs=None if lps is None else np.frombuffer(lps, dtype=LOGPROB_DTYPE).tolist())


def rids_in_frame(data: bytes) -> list[str]:
    """The request ids a worker frame names (an `err`'s rid, an `out`'s row rids), read leniently from a
    frame that failed to decode, so the receiver can end exactly the requests whose output it lost."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        return []
    if not isinstance(obj, dict):
        return []
    rows = obj.get("items") if obj.get("t") == OUT else [[obj.get("rid")]]
    if not isinstance(rows, list):
        return []
    found = [row[0] for row in rows if isinstance(row, list) and row and isinstance(row[0], str)]
    return [rid for rid in dict.fromkeys(found) if 0 < len(rid) <= MAX_RID_LEN]


def _decode_out_items(obj: dict[str, Any], sent_at: float) -> list[OutItem]:
    rows = _field(obj, "items", list, None)
    items: list[OutItem] = []
    for row in rows:
        if not isinstance(row, list) or len(row) not in (5, 6):
            raise ProtocolError("out item is not a 5- or 6-element list")
        items.append(_out_item(row, sent_at))
        if len(row) == 6:
            items[-1].top_ids, items[-1].top_logprobs = _unpack_top(row[5], len(items[-1].tokens))
    return items


def _decode_stats(obj: dict[str, Any]) -> WorkerStats:
    stats = WorkerStats(
        worker_id=_field(obj, "worker_id", str, None), queue=_field(obj, "queue", int, None),
        running=_field(obj, "running", int, None), kv_free=_field(obj, "kv_free", int, None),
        kv_total=_field(obj, "kv_total", int, None),
        hit_rate=float(_field(obj, "hit_rate", (int, float), None)),
        draining=_field(obj, "draining", bool, None), model=_field(obj, "model", str, None),
        version=_field(obj, "version", int, None),
    )
    role = obj.get("role", "both")
    if role not in ROLES:
        raise ProtocolError(f"stats role must be one of {ROLES}")
    stats.role = role
    decode_costs(obj, stats)
    if "kv" in obj:  # a bad kv part costs a snapshot request, not the worker's stats
        try:
            stats.kv = decode_kv(obj["kv"])
        except ValueError as exc:
            stats.kv_error = str(exc)
    return stats


def decode_worker_frame(data: bytes) -> OutFrame | ErrFrame | WorkerStats:
    """Decode a worker -> gw frame. Raises ProtocolError."""
    obj = _load_map(data)
    kind = obj.get("t")
    try:
        if kind == OUT:
            ts = obj.get("ts", 0.0)
            sent_at = float(ts) if isinstance(ts, int | float) else 0.0
            return OutFrame(_decode_out_items(obj, sent_at), sent_at)
        if kind == ERR:
            return ErrFrame(rid=_field(obj, "rid", str, None), code=ErrorCode(_field(obj, "code", str, None)),
                            message=_field(obj, "message", str, None),
                            retryable=_field(obj, "retryable", bool, None))
        if kind == STATS:
            return _decode_stats(obj)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"malformed {kind} frame: {exc}") from None
    raise ProtocolError(f"unknown frame type {kind!r}"[:80])
