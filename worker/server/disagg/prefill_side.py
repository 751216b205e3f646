"""Disaggregated prefill, prefill side: a decode worker's `pf` becomes a one-token engine request whose full
pages are pushed back to it as `kv` chunks while its prefill runs; the last message carries the first token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from common.priorities import Priority
from worker import protocol as proto
from worker.engine.core import Engine, StepOutput
from worker.engine.export import ReadyPages
from worker.protocol import FirstToken, KvChunk, PrefillRequest, RequestError, SamplingParams
from worker.server.process.inflight import InFlightTable
from worker.server.telemetry.worker_metrics import DISAGG_PUSHED

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 8 << 20  # page rows per `kv` message, at most (the receiver's frame bound is larger)
SendParts = Callable[[bytes, list], None]


@dataclass(slots=True)
class Job:
    ident: bytes  # the decode worker's link
    xid: str
    dest: np.ndarray  # its page per block from `skip` on
    skip: int
    max_tokens: int  # the request's own: with 1, the prefill's token ends it


class PrefillSide:
    def __init__(self, engine: Engine, table: InFlightTable, send_parts: SendParts, role: str,
                 fingerprint: bytes) -> None:
        self.engine = engine
        self.table = table
        self.send_parts = send_parts
        self.role = role
        self.fingerprint = fingerprint
        # an engine without page exports (vLLM's) prefills for nobody: `_refusal` sees its cache is None
        self.page_bytes = engine.exports.codec.page_bytes if engine.exports is not None else 0
        self.jobs: dict[str, Job] = {}  # engine rid -> job

    def _refusal(self, req: PrefillRequest, draining: bool) -> tuple[str, str] | None:
        bs = self.engine.config.block_size
        if self.role == "decode" or self.engine.cache is None:
            return "refused", "this worker does not prefill for others"
        if draining:
            return "draining", "the prefill worker is draining"
        if req.fingerprint != self.fingerprint or req.page_bytes != self.page_bytes:
            return "incompatible", "model, tokenizer, KV dtype or page layout differ"
        if req.skip + len(req.dest) != len(req.tokens) // bs:
            return "bad_request", "skip + dest must count the prompt's full blocks"
        return None

    def admit(self, ident: bytes, req: PrefillRequest, draining: bool) -> None:
        refusal = self._refusal(req, draining)
        if refusal is None and self.table.find(ident, req.xid) is not None:
            refusal = "bad_request", "duplicate transfer id"
        if refusal is not None:
            self._error(ident, req.xid, *refusal)
            return
        try:
            sampling = SamplingParams.from_dict(req.sampling)
            one = replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))
            priority = Priority(req.priority)
        except (RequestError, TypeError, ValueError) as exc:
            self._error(ident, req.xid, "bad_request", f"bad sampling: {getattr(exc, 'message', exc)}")
            return
        entry = self.table.add(ident, req.xid, req.deadline, time.monotonic())
        try:
            self.engine.add_request(entry.engine_rid, req.tokens.tolist(), one, priority=priority,
                                    namespace=req.ns, fkey=req.fkey, weight=req.weight)
        except RequestError as exc:
            self.table.remove(entry.engine_rid)
            self._error(ident, req.xid, "bad_request" if exc.code == "bad_request" else "capacity",
                        exc.message)
            return
        self.engine.exports.watch(entry.engine_rid, req.skip, req.skip + len(req.dest))
        self.jobs[entry.engine_rid] = Job(ident, req.xid, req.dest, req.skip, sampling.max_tokens)

    def abort(self, ident: bytes, xid: str) -> None:
        entry = self.table.find(ident, xid)
        if entry is not None:
            self.jobs.pop(entry.engine_rid, None)
            self.table.remove(entry.engine_rid)
            self.engine.abort(entry.engine_rid)

    def owns(self, engine_rid: str) -> bool:
        """`engine_rid` is a prefill job for a decode worker (not a gateway's request)."""
        return engine_rid in self.jobs

    def forget(self, engine_rid: str) -> None:
        """The request ended on the server's side (its engine abort drops the pages it watched)."""
        self.jobs.pop(engine_rid, None)

    def stepped(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Push the pages this step computed, then each finished job's first token; returns the other
        outputs."""
        for ready in self.engine.exports.take():
            job = self.jobs.get(ready.rid)
            if job is not None:
                self._push(job, ready)
        rest = []
        for out in outputs:
            job = self.jobs.get(out.rid)
            if job is None:
                rest.append(out)
            elif out.finish_reason is not None:
                self._finish(out.rid, job, out)
        return rest

    def _push(self, job: Job, ready: ReadyPages) -> None:
        per_msg = max(1, MAX_CHUNK_BYTES // self.page_bytes)
        rows = ready.rows.numpy()
        for lo in range(0, len(rows), per_msg):
            part = rows[lo:lo + per_msg]  # a view: sent without a copy
            at = ready.first_block + lo - job.skip
            chunk = KvChunk(job.xid, ready.first_block + lo, job.dest[at:at + len(part)], self.page_bytes,
                            None)
            self.send_parts(job.ident, [proto.encode_kv_header(chunk), part])
            DISAGG_PUSHED.inc(part.nbytes)

    def _finish(self, engine_rid: str, job: Job, out: StepOutput) -> None:
        self.jobs.pop(engine_rid, None)
        self.table.remove(engine_rid)
        self.engine.exports.forget(engine_rid)
        if out.error is not None:
            self._error(job.ident, job.xid, "error", out.error.message)
            return
        if out.finish_reason == "abort":
            return
        finish = None if out.finish_reason == "length" and job.max_tokens > 1 else out.finish_reason
        ft = FirstToken(out.new_tokens, finish, out.cached_tokens, out.logprobs, out.top_ids,
                        out.top_logprobs)
        last = KvChunk(job.xid, len(job.dest) + job.skip, job.dest[:0], self.page_bytes, b"", first_token=ft)
        self.send_parts(job.ident, [proto.encode_kv_header(last), b""])

    def _error(self, ident: bytes, xid: str, reason: str, message: str) -> None:
        log.info("prefill transfer %s refused or failed: %s (%s)", xid, reason, message)
        self.send_parts(ident, [proto.encode_kv_error(xid, reason, message)])
