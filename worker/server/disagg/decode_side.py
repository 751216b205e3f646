"""Disaggregated prefill, decode side: a `gen` with a prefill hint leases pages for the blocks this worker
lacks and asks the prefill worker for them; pushed pages are written as they arrive, then the request runs as
after a cache hit. A transfer that fails or stalls keeps the pages that arrived as a cached prefix and
prefills the rest here.
"""

from __future__ import annotations

import logging
import secrets
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from worker import protocol as proto
from worker.engine.core import DEFAULT_NAMESPACE, Engine
from worker.kvcache.radix_cache import RadixNode
from worker.protocol import FirstToken, GenRequest, KvChunk, KvError, OutItem, SamplingParams
from worker.server.disagg.prefill_links import Link, PrefillLinks
from worker.server.process.inflight import InFlight
from worker.server.telemetry import worker_metrics as m

log = logging.getLogger(__name__)

# entry, req, tokens, sampling, resumed
AddLocal = Callable[[InFlight, GenRequest, list[int], SamplingParams, int], bool]
SendOut = Callable[[InFlight, OutItem], None]


@dataclass(slots=True)
class Lease:
    xid: str
    entry: InFlight
    req: GenRequest
    sampling: SamplingParams
    link: Link
    ns: bytes
    prompt: list[int]
    held: int  # leading full blocks this worker held (locked by `handle`, one ref each in `held_pages`)
    held_pages: list[int]
    handle: RadixNode | None
    pages: list[int]  # leased: one per block the prefill worker pushes
    expires: float  # monotonic
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    arrived: int = 0  # leading leased pages written


class DecodeSide:
    def __init__(self, engine: Engine, links: PrefillLinks, add_local: AddLocal, send_out: SendOut,
                 fingerprint: bytes, stall_s: float, lease_s: float) -> None:
        self.engine = engine
        self.links = links
        self.add_local = add_local
        self.send_out = send_out
        self.fingerprint = fingerprint
        self.stall_s = stall_s
        self.lease_s = lease_s
        # None (an engine without page exports: vLLM's): `start` says no_cache before it is needed
        self.codec = engine.exports.codec if engine.exports is not None else None
        self.bs = engine.config.block_size
        self.leases: dict[str, Lease] = {}  # by xid
        self.by_rid: dict[str, str] = {}  # engine rid -> xid

    # ------------------------------------------------------------ starting a transfer

    def start(self, entry: InFlight, req: GenRequest, sampling: SamplingParams) -> str | None:
        """Lease pages and ask the hinted prefill worker to fill them: None when the transfer started, else
        the reason the request prefills here (the caller adds it to the engine as usual)."""
        assert req.prefill is not None
        engine, cache, pool = self.engine, self.engine.cache, self.engine.pool
        prompt = req.tokens.tolist()
        if cache is None:
            return "no_cache"
        if req.resumed:
            return "resumed"
        try:
            engine.check_request(entry.engine_rid, prompt, sampling, req.priority, req.ns, req.fkey,
                                 req.weight)
        except proto.RequestError:
            return "invalid"  # the local path answers with the error
        now = time.monotonic()
        ns = req.ns or DEFAULT_NAMESPACE
        n_full = len(prompt) // self.bs
        if n_full == 0:
            return "short"
        held = cache.peek(ns, prompt[:n_full * self.bs]) // self.bs
        if held >= n_full:
            return "cached"
        if len(self.leases) + len(engine.scheduler.running) >= engine.config.max_num_seqs:
            # a lease is a sequence to come: past max_num_seqs it waits in the fair queue instead
            return "seqs"
        link = self.links.get(req.prefill.endpoint, now)
        if link is None:
            return "links"
        match = cache.match_prefix(ns, prompt[:held * self.bs]) if held else None
        pages = engine.scheduler.take_pages(n_full - held)
        if pages is None:
            if match is not None:
                pool.release(match.pages)
                cache.unlock(match.handle)
            return "decode_pages"
        lease = Lease(secrets.token_hex(8), entry, req, sampling, link, ns, prompt, held,
                      match.pages if match else [], match.handle if match else None, pages,
                      expires=now + self.lease_s)
        if not self.links.send(link, proto.encode_prefill(self._request(lease)), now):
            self._close(lease)
            return "link"
        self.leases[lease.xid] = lease
        self.by_rid[entry.engine_rid] = lease.xid
        return None

    def _request(self, lease: Lease) -> proto.PrefillRequest:
        req = lease.req
        unix_deadline = time.time() + self.lease_s
        if req.deadline:
            unix_deadline = min(unix_deadline, req.deadline)
        return proto.PrefillRequest(
            xid=lease.xid, ns=req.ns, tokens=np.asarray(req.tokens, dtype=np.int32), sampling=req.sampling,
            skip=lease.held, dest=np.asarray(lease.pages, dtype=np.int32), fingerprint=self.fingerprint,
            page_bytes=self.codec.page_bytes, deadline=unix_deadline, priority=int(req.priority),
            fkey=req.fkey, weight=req.weight)

    # ------------------------------------------------------------ replies

    def drain(self) -> None:
        """Take in every waiting reply, then fall back for transfers whose prefill worker dropped."""
        for link, parts in self.links.replies():
            self._reply(link, parts)
        for link in self.links.dropped():
            for lease in [x for x in self.leases.values() if x.link is link]:
                self._fallback(lease, "prefill_lost")

    def _reply(self, link: Link, parts: list) -> None:
        try:
            msg = proto.decode_prefill_reply([parts[0].bytes, *parts[1:]])
        except proto.TransferFrameError as exc:
            lease = self.leases.get(exc.xid) if exc.xid else None
            if lease is not None and lease.link is link:
                log.warning("malformed transfer frame for %s: %s", lease.xid, exc.message)
                self._fallback(lease, "malformed")
            return  # not a transfer frame (the prefill worker's stats) or a stray one
        lease = self.leases.get(msg.xid)
        if lease is None or lease.link is not link:
            m.DISAGG_STRAY.inc()
            return
        if isinstance(msg, KvError):
            log.info("prefill worker ended transfer %s: %s (%s)", msg.xid, msg.reason, msg.message)
            self._fallback(lease, msg.reason if msg.reason in m.DISAGG_REASONS else "error")
            return
        if not self._write(lease, msg):
            self._fallback(lease, "malformed")
        elif msg.first_token is not None:
            self._complete(lease, msg.first_token)

    def _write(self, lease: Lease, chunk: KvChunk) -> bool:
        """Write a chunk's rows into the leased pages; False when it does not continue the transfer in order
        or holds numbers no page can (`PageCodec.finite`)."""
        at = chunk.first - lease.held
        end = at + chunk.n
        if at != lease.arrived or end > len(lease.pages) or chunk.page_bytes != self.codec.page_bytes:
            return False
        if not np.array_equal(chunk.dest, lease.pages[at:end]):
            return False
        if chunk.first_token is not None and end != len(lease.pages):
            return False  # the first token came before every page did
        if chunk.n:
            with warnings.catch_warnings():  # the frame is read-only: we only read it
                warnings.simplefilter("ignore", UserWarning)
                rows = torch.frombuffer(chunk.data.buffer, dtype=torch.uint8).view(chunk.n, chunk.page_bytes)
            if not self.codec.finite(rows):
                return False  # NaN, inf or a negative scale from the peer: prefilled here instead
            self.codec.write(lease.pages[at:end], rows)
            m.DISAGG_BYTES.inc(chunk.n * chunk.page_bytes)
        lease.arrived = end
        lease.last_progress = time.monotonic()
        return True

    # ------------------------------------------------------------ ends

    def _complete(self, lease: Lease, first: FirstToken) -> None:
        kept = self._close(lease)
        m.DISAGG_TRANSFERS.labels("complete").inc()
        m.DISAGG_SECONDS.observe(time.monotonic() - lease.started)
        cached = max(lease.held * self.bs, first.cached_tokens)
        entry = lease.entry
        item = OutItem(entry.rid, first.tokens, first.finish_reason, cached, first.logprobs,
                       top_ids=first.top_ids, top_logprobs=first.top_logprobs)
        if first.finish_reason is not None or not first.tokens:
            item.finish_reason = item.finish_reason or "stop"
            self.send_out(entry, item)
            return
        if self.add_local(entry, lease.req, lease.prompt + first.tokens, lease.sampling, 1):
            self.engine.pins.pin(entry.engine_rid, lease.ns, kept)  # evictable only once it is admitted
            self.send_out(entry, item)

    def _fallback(self, lease: Lease, reason: str) -> None:
        """Keep the pages that arrived as a cached prefix; prefill the rest here (the client sees no
        error)."""
        kept = self._close(lease)
        self.links.send(lease.link, proto.encode_prefill_abort(lease.xid), time.monotonic())
        m.DISAGG_TRANSFERS.labels("fallback").inc()
        m.DISAGG_FALLBACKS.labels(reason).inc()
        if self.add_local(lease.entry, lease.req, lease.prompt, lease.sampling, 0):
            self.engine.pins.pin(lease.entry.engine_rid, lease.ns, kept)

    def cancel(self, engine_rid: str) -> bool:
        """The request ended before its transfer did (abort, deadline, gateway gone): free its lease."""
        xid = self.by_rid.get(engine_rid)
        if xid is None:
            return False
        lease = self.leases[xid]
        self._close(lease)
        self.links.send(lease.link, proto.encode_prefill_abort(xid), time.monotonic())
        m.DISAGG_TRANSFERS.labels("cancelled").inc()
        return True

    def _close(self, lease: Lease) -> list[int]:
        """Forget the lease: its held and arrived pages join the radix cache, the rest return to the pool; the
        prompt tokens whose pages were kept."""
        self.leases.pop(lease.xid, None)
        self.by_rid.pop(lease.entry.engine_rid, None)
        cache, pool, keep = self.engine.cache, self.engine.pool, lease.held + lease.arrived
        assert cache is not None
        if keep:
            cache.insert(lease.ns, lease.prompt[:keep * self.bs],
                         lease.held_pages + lease.pages[:lease.arrived])
        pool.release(lease.pages[lease.arrived:])
        cache.unlock(lease.handle)
        return lease.prompt[:keep * self.bs]

    def housekeeping(self, now: float) -> None:
        for lease in list(self.leases.values()):
            # stalled: the prefill worker is silent (its stats keep coming while it queues or computes our
            # prompt)
            silent = now - max(lease.last_progress, lease.link.last_heard)
            if silent > self.stall_s or now > lease.expires:
                log.warning("transfer %s stalled: prefilling here", lease.xid)
                self._fallback(lease, "stall")
        self.links.housekeeping(now, {lease.link.endpoint for lease in self.leases.values()})

    def close(self) -> None:
        for lease in list(self.leases.values()):
            self._close(lease)
        self.links.close()
