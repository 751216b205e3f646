"""Disaggregated prefill on the wire: worker roles, the gateway's prefill hint on `gen`, the decode worker's
`pf`/`pfabort` to a prefill worker, and the prefill worker's `kv` chunks (msgpack header + raw page rows) and
`kverr`. Private to `worker.protocol`, which re-exports every name; import them from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

__all__ = ["FINGERPRINT_LEN", "KV", "KV_ERR", "PF", "PF_ABORT", "FirstToken", "KvChunk", "KvError",
           "PrefillAbort", "PrefillHint", "PrefillRequest", "TransferFrameError", "decode_prefill_reply",
           "encode_kv_error", "encode_kv_header", "encode_prefill", "encode_prefill_abort"]

PF = "pf"
PF_ABORT = "pfabort"
KV = "kv"
KV_ERR = "kverr"
MAX_XID_LEN = 64
MAX_ENDPOINT_LEN = 256
FINGERPRINT_LEN = 16
MAX_CHUNK_PAGES = 4096
PAGE_DTYPE = np.dtype("<i4")
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


class TransferFrameError(ValueError):
    """A malformed transfer frame; `xid` is set when it named a usable transfer id (that transfer ends)."""

    def __init__(self, message: str, xid: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.xid = xid


@dataclass(slots=True)
class PrefillHint:
    """On a `gen` frame: prefill this request on that worker and receive its pages (the gateway's choice)."""

    worker_id: str
    endpoint: str


@dataclass(slots=True)
class PrefillRequest:
    """decode -> prefill: compute `tokens`, sample the first token, push full pages from block `skip` on."""

    xid: str
    ns: bytes
    tokens: np.ndarray  # int32 prompt
    sampling: dict[str, Any]
    skip: int  # leading full blocks the decode worker holds already
    dest: np.ndarray  # int32: the decode worker's page for each block from `skip` on (echoed back per chunk)
    fingerprint: bytes  # worker.kvcache.tiers.pages.fingerprint: model, tokenizer, KV dtype, layout
    page_bytes: int
    deadline: float  # unix seconds: the lease's end
    priority: int = 0
    fkey: bytes = b""
    weight: float = 1.0


@dataclass(slots=True)
class PrefillAbort:
    xid: str


@dataclass(slots=True)
class FirstToken:
    """The last `kv` chunk's sampled result: the first output token (none when the prompt ended the
    request)."""

    tokens: list[int]
    finish_reason: str | None
    cached_tokens: int  # prompt tokens the prefill worker's own cache served
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass(slots=True)
class KvChunk:
    """prefill -> decode: `n` pages starting at block `first`, as rows of `page_bytes` in `data`."""

    xid: str
    first: int
    dest: np.ndarray  # int32 pages the decode worker named for these blocks
    page_bytes: int
    data: Any  # buffer of n * page_bytes bytes (a zmq Frame's buffer on receipt: no copy)
    first_token: FirstToken | None = None  # set on the last chunk only
    n: int = field(init=False)

    def __post_init__(self) -> None:
        self.n = len(self.dest)


@dataclass(slots=True)
class KvError:
    xid: str
    reason: str  # a fallback reason: incompatible, refused, capacity, error
    message: str


# ---------------------------------------------------------------- encoders

def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def hint_field(hint: PrefillHint) -> dict[str, str]:
    return {"w": hint.worker_id, "ep": hint.endpoint}


def encode_prefill(req: PrefillRequest) -> bytes:
    return _pack({"t": PF, "xid": req.xid, "ns": bytes(req.ns),
                  "tokens": req.tokens.astype(TOKEN_DTYPE).tobytes(), "sampling": req.sampling,
                  "skip": req.skip, "dest": req.dest.astype(PAGE_DTYPE).tobytes(), "fp": req.fingerprint,
                  "pb": req.page_bytes, "deadline": req.deadline, "priority": req.priority,
                  "fkey": bytes(req.fkey), "weight": req.weight})


def encode_prefill_abort(xid: str) -> bytes:
    return _pack({"t": PF_ABORT, "xid": xid})


def encode_kv_header(chunk: KvChunk) -> bytes:
    """The header part of a `kv` message; the page rows travel as the next part (sent without a copy)."""
    obj: dict[str, Any] = {"t": KV, "xid": chunk.xid, "first": chunk.first,
                           "dest": np.asarray(chunk.dest, dtype=PAGE_DTYPE).tobytes(), "pb": chunk.page_bytes}
    ft = chunk.first_token
    if ft is not None:
        obj["tok"] = np.asarray(ft.tokens, dtype=TOKEN_DTYPE).tobytes()
        obj["fin"] = ft.finish_reason
        obj["cached"] = ft.cached_tokens
        obj["lp"] = None if ft.logprobs is None else np.asarray(ft.logprobs, dtype=LOGPROB_DTYPE).tobytes()
        if ft.top_ids is not None and ft.top_logprobs is not None:
            obj["top"] = [[int(t) for t in row] for row in ft.top_ids]
            obj["toplp"] = [[float(v) for v in row] for row in ft.top_logprobs]
    return _pack(obj)


def encode_kv_error(xid: str, reason: str, message: str) -> bytes:
    return _pack({"t": KV_ERR, "xid": xid, "reason": reason, "message": message[:256]})


# ---------------------------------------------------------------- decoders

def _xid(obj: dict[str, Any]) -> str:
    xid = obj.get("xid")
    if not isinstance(xid, str) or not 0 < len(xid) <= MAX_XID_LEN:
        raise TransferFrameError("transfer frame without a usable 'xid'")
    return xid


def _get(obj: dict[str, Any], name: str, kinds: type | tuple[type, ...], xid: str) -> Any:
    value = obj.get(name)
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,)):
        raise TransferFrameError(f"transfer field {name!r} is missing or has the wrong type", xid)
    return value


def _int32s(raw: bytes, name: str, xid: str) -> np.ndarray:
    if len(raw) % 4:
        raise TransferFrameError(f"transfer field {name!r} is not packed int32", xid)
    return np.frombuffer(raw, dtype=PAGE_DTYPE)


def decode_hint(raw: Any, rid: str) -> PrefillHint:
    """The `prefill` field of a gen frame; ValueError when it is not {"w": str, "ep": tcp endpoint}."""
    if not isinstance(raw, dict):
        raise ValueError("prefill must be a map")
    wid, ep = raw.get("w"), raw.get("ep")
    if not isinstance(wid, str) or not 0 < len(wid) <= MAX_ENDPOINT_LEN:
        raise ValueError("prefill.w must be a worker id")
    if not isinstance(ep, str) or not ep.startswith(("tcp://", "ipc://")) or len(ep) > MAX_ENDPOINT_LEN:
        raise ValueError("prefill.ep must be a tcp:// or ipc:// endpoint")
    return PrefillHint(wid, ep)


def decode_prefill(obj: dict[str, Any], max_prompt_tokens: int) -> PrefillRequest | PrefillAbort:
    """A `pf` or `pfabort` frame already unpacked as `obj`; TransferFrameError on anything invalid."""
    xid = _xid(obj)
    if obj.get("t") == PF_ABORT:
        return PrefillAbort(xid)
    tokens = _int32s(_get(obj, "tokens", bytes, xid), "tokens", xid)
    if not 0 < len(tokens) <= max_prompt_tokens:
        raise TransferFrameError(f"prefill prompt must have 1 to {max_prompt_tokens} tokens", xid)
    skip = _get(obj, "skip", int, xid)
    dest = _int32s(_get(obj, "dest", bytes, xid), "dest", xid)
    fp = _get(obj, "fp", bytes, xid)
    page_bytes = _get(obj, "pb", int, xid)
    deadline = float(_get(obj, "deadline", (int, float), xid))
    weight = float(_get(obj, "weight", (int, float), xid))
    if skip < 0 or len(dest) == 0 or len(dest) > MAX_CHUNK_PAGES * 64 or page_bytes <= 0:
        raise TransferFrameError("prefill skip, dest or page size out of range", xid)
    if len(fp) != FINGERPRINT_LEN or not math.isfinite(deadline) or not 0 < weight <= 1000:
        raise TransferFrameError("prefill fingerprint, deadline or weight is invalid", xid)
    return PrefillRequest(xid=xid, ns=_get(obj, "ns", bytes, xid)[:1024], tokens=tokens,
                          sampling=_get(obj, "sampling", dict, xid), skip=skip, dest=dest, fingerprint=fp,
                          page_bytes=page_bytes, deadline=deadline, priority=_get(obj, "priority", int, xid),
                          fkey=_get(obj, "fkey", bytes, xid)[:64], weight=weight)


def _first_token(obj: dict[str, Any], xid: str) -> FirstToken:
    tokens = _int32s(_get(obj, "tok", bytes, xid), "tok", xid).tolist()
    fin = obj.get("fin")
    cached = _get(obj, "cached", int, xid)
    lp = obj.get("lp")
    if (fin is not None and not isinstance(fin, str)) or len(tokens) > 1 or cached < 0:
        raise TransferFrameError("kv first token is malformed", xid)
    if lp is not None and (not isinstance(lp, bytes) or len(lp) != 4 * len(tokens)):
        raise TransferFrameError("kv first token logprobs are malformed", xid)
    ft = FirstToken(tokens, fin, cached,
                    None if lp is None else np.frombuffer(lp, dtype=LOGPROB_DTYPE).tolist())
    top, toplp = obj.get("top"), obj.get("toplp")
    if top is not None:
        if not (isinstance(top, list) and isinstance(toplp, list) and len(top) == len(toplp) == len(tokens)):
            raise TransferFrameError("kv first token top logprobs are malformed", xid)
        ft.top_ids, ft.top_logprobs = top, toplp
    return ft


def decode_prefill_reply(parts: list[Any]) -> KvChunk | KvError:
    """A message from a prefill worker: [kv header, page rows], [kverr] or [err]. Other frames (its stats)
    raise TransferFrameError with no xid: the caller ignores them."""
    try:
        obj = msgpack.unpackb(bytes(parts[0]), raw=False, strict_map_key=True)
    except Exception:
        raise TransferFrameError("transfer frame is not valid msgpack") from None
    kind = obj.get("t") if isinstance(obj, dict) else None
    if kind == "err" and isinstance(obj.get("rid"), str):  # the worker ended the prefill (deadline, drain)
        return KvError(obj["rid"][:MAX_XID_LEN], "ended", str(obj.get("message", ""))[:256])
    if kind not in (KV, KV_ERR):
        raise TransferFrameError(f"not a transfer frame: {kind!r}"[:80])
    xid = _xid(obj)
    if kind == KV_ERR:
        return KvError(xid, str(obj.get("reason", "error"))[:32], str(obj.get("message", ""))[:256])
    if len(parts) != 2:
        raise TransferFrameError("kv message is not [header, pages]", xid)
    first = _get(obj, "first", int, xid)
    dest = _int32s(_get(obj, "dest", bytes, xid), "dest", xid)
    page_bytes = _get(obj, "pb", int, xid)
    data = parts[1]
    size = len(data.buffer) if hasattr(data, "buffer") else len(data)
    if first < 0 or page_bytes <= 0 or len(dest) > MAX_CHUNK_PAGES or size != len(dest) * page_bytes:
        raise TransferFrameError("kv chunk size does not match its pages", xid)
    chunk = KvChunk(xid, first, dest, page_bytes, data)
    if "tok" in obj:
        chunk.first_token = _first_token(obj, xid)
    return chunk
