"""The worker's ZeroMQ server: one engine behind a ROUTER socket, served by a single-threaded loop that
turns frames into engine calls and each engine step into one `out` frame per gateway.
"""

from __future__ import annotations

import logging
import socket
import time

import zmq

from common.worker_registry import Registration
from worker import protocol as proto
from worker.engine.core import Engine
from worker.kvcache.events import KvPromises
from worker.protocol import ErrorCode, GenRequest, OutItem, RequestError, SamplingParams
from worker.server.disagg.decode_side import DecodeSide
from worker.server.disagg.prefill_links import PrefillLinks
from worker.server.disagg.prefill_side import PrefillSide
from worker.server.process import arrivals
from worker.server.process.drain import DRAIN_EXPIRED_MESSAGE, DRAINING_MESSAGE, HANDOFF_MESSAGE, Drain
from worker.server.process.inflight import InFlight, InFlightTable
from worker.server.process.kv_publisher import KvEventPublisher, server_publisher
from worker.server.process.link_auth import LinkAuth
from worker.server.process.memory import MemoryReport, TrimSchedule
from worker.server.process.registry import Registrar
from worker.server.process.server_config import ServerConfig, advertised_endpoint
from worker.server.process.stats_pulse import StatsPulse, stats_frame
from worker.server.telemetry.worker_metrics import DISAGG_FALLBACKS, WorkerMetrics
from worker.server.telemetry.worker_spans import RequestSpans

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 0.05
MAX_FRAME_BYTES = 16 << 20
MAX_FRAMES_PER_DRAIN = 4096  # bound one drain so that a flood cannot starve the running streams
DRAIN_BUDGET_S = 0.05  # ... and its time: the loop gets back to steps at least this often (to stats when due)
COMPILE_POLL_S = 0.005  # idle wait while only grammar compiles are pending


class WorkerServer:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.max_prompt_tokens = int(engine.max_context)
        self.table = InFlightTable()
        self.drain = Drain(config.drain_timeout, config.drain_handoff)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._auth: LinkAuth | None = None
        self.endpoint = ""
        self.worker_id = config.worker_id or ""
        self._registrar: Registrar | None = None
        self._next_stats = 0.0
        self._next_housekeeping = 0.0
        self._trim = TrimSchedule()
        self._memory_report = MemoryReport()  # debug only: off unless SWITCHYARD_MEMORY_REPORT is set
        self._pulse: StatsPulse | None = None
        self._last_stats = b""
        self.metrics = WorkerMetrics(engine)
        self.spans = RequestSpans(engine, self.metrics)  # traced requests only: no-op with no tracer provider
        self._promises = None if engine.cache is None else KvPromises(engine.cache, engine.config.block_size)
        self._kv_pub: KvEventPublisher | None = None  # vLLM-format KV events, when configured
        fp = engine.kv_fingerprint
        self.prefill = PrefillSide(engine, self.table, self._send_parts, config.role, fp)
        links = PrefillLinks(self.ctx, config.cluster_key, config.worker_id or "")
        self.decode = DecodeSide(engine, links, self._add_to_engine, self._deliver, fp, config.disagg_stall_s,
                                 config.disagg_lease_s)

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> str:
        """Bind the ROUTER socket, CURVE-secured given a cluster key (InsecureBind: an open port without)."""
        sock = self.sock
        self._auth = LinkAuth(self.ctx, self.config.cluster_key, self.config.bind)
        self._auth.secure(sock)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not a silent drop
        # A reconnecting gateway takes its identity back; identities are random and peers authenticated.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.bind(self.config.bind)
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint = self.config.advertise or advertised_endpoint(bound)
        if not self.worker_id:
            self.worker_id = f"{socket.gethostname()}-{bound.rsplit(':', 1)[-1]}"
        self._kv_pub = server_publisher(self.ctx, self.config, self.engine, self.worker_id, self._auth)
        log.info("worker %s listening on %s (advertised %s)", self.worker_id, bound, self.endpoint)
        return self.endpoint

    def register(self) -> None:
        if self.config.redis_url:
            reg = Registration(worker_id=self.worker_id, endpoint=self.endpoint, model=self.engine.model_id,
                               version=proto.PROTOCOL_VERSION, started_at=time.time(), role=self.config.role,
                               model_version=self.config.model_version, spec=self.config.model_spec,
                               tokenizer=self.engine.tokenizer_version, pool=self.config.pool,
                               engine=self.engine.kind)
            self._registrar = Registrar(self.config.redis_url, reg)
            self._registrar.start()

    def run(self, signals: bool = True) -> int:
        """Serve until a drain completes (returns 0); `signals`: SIGTERM/SIGINT start it (main thread only)"""
        if not self.endpoint:
            self.bind()
        if signals:
            self.drain.install_signal_handlers()
        self.register()
        self._pulse = StatsPulse(self.sock, self.config.stats_interval)
        self.engine.prepare_grammars()  # not in a tenant's first constrained request: see GrammarCache.warm
        try:
            self._loop()
        finally:
            self._pulse.close()
            self._shutdown()
        return 0

    def _shutdown(self) -> None:
        if self._registrar is not None:
            self._registrar.stop()
        self._send_stats()  # last word: draining=true
        self.decode.close()
        self._kv_pub and self._kv_pub.close()
        self.engine.close()
        self.sock.close()
        if self._auth is not None:
            self._auth.close()
        self.ctx.term()
        log.info("worker %s stopped", self.worker_id)

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        engine = self.engine
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        self.decode.links.poller = poller  # pages from prefill workers wake the loop too
        while True:
            if engine.ready():
                self._drain_socket(poller, 0)
            else:
                wait_s = max(0.0, min(self._next_stats, self._next_housekeeping) - time.monotonic())
                if engine.has_work():  # only compiles pending: look again soon
                    wait_s = min(wait_s, COMPILE_POLL_S)
                self._drain_socket(poller, int(wait_s * 1000) + 1)
                if engine.ready():  # it was idle: a burst shares its first step
                    arrivals.gather(poller, lambda: self._drain_socket(poller, 0))
            now = time.monotonic()
            if now >= self._next_housekeeping:
                self._housekeeping(now)
                if self.drain.active and len(self.table) and self.drain.handoff_due(now):
                    self._end_all(ErrorCode.DRAINING, HANDOFF_MESSAGE, retryable=True)  # resumed elsewhere
                    return
                if self.drain.active and len(self.table) == 0:
                    self._drain_socket(poller, 0)  # frames sent before the drain get its refusal, not silence
                if self.drain.active and (len(self.table) == 0 or self.drain.expired(now)):
                    self._end_all(ErrorCode.CAPACITY, DRAIN_EXPIRED_MESSAGE, retryable=True)
                    return
            if engine.ready():
                self._step()
            if time.monotonic() >= self._next_stats:
                self._send_stats()

    def _drain_socket(self, poller: zmq.Poller, timeout_ms: int) -> None:
        if not poller.poll(timeout_ms):
            return
        if self.decode.links.links:
            self.decode.drain()
        recv = self.sock.recv_multipart
        until = min(time.monotonic() + DRAIN_BUDGET_S, self._next_stats)  # stats due: report first
        for _ in range(MAX_FRAMES_PER_DRAIN):
            try:
                parts = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2:
                log.warning("dropping message with %d parts (want identity + one frame)", len(parts))
            else:
                try:
                    self._handle(parts[0], parts[1])
                except Exception:  # a frame must never take the worker down
                    log.exception("unexpected error handling a frame from gateway %r", parts[0][:64])
            if time.monotonic() >= until:
                return  # the rest waits in the socket while the loop steps and reports

    def _handle(self, ident: bytes, data: bytes) -> None:
        if self.table.seen(ident, time.monotonic()):
            self._send_stats_to(ident)  # a new gateway learns our state at once
        try:
            frame = proto.decode_gateway_frame(data, self.max_prompt_tokens)
        except proto.TransferFrameError as exc:
            log.warning("dropping bad prefill frame from %r: %s", ident[:64], exc.message)
            if exc.xid is not None:
                self._send(ident, proto.encode_kv_error(exc.xid, "bad_request", exc.message))
            return
        except proto.ProtocolError as exc:
            if exc.rid is None:
                log.warning("dropping bad frame from gateway %r: %s", ident[:64], exc.message)
            else:
                log.info("rejecting request %s: %s", exc.rid, exc.message, extra={"request_id": exc.rid})
                self._send(ident, proto.encode_err(exc.rid, ErrorCode.BAD_REQUEST, exc.message, False))
            return
        if isinstance(frame, proto.GenRequest):
            self._admit(ident, frame)
        elif isinstance(frame, proto.Sync):
            self._send_stats_to(ident)
        elif isinstance(frame, proto.PrefillRequest):
            self.prefill.admit(ident, frame, self.drain.active)
        elif isinstance(frame, proto.PrefillAbort):
            self.prefill.abort(ident, frame.xid)
        elif isinstance(frame, proto.Abort):
            entry = self.table.find(ident, frame.rid)
            if entry is not None and not entry.client_aborted:
                entry.client_aborted = True
                if not self.engine.abort(entry.engine_rid):
                    self.decode.cancel(entry.engine_rid)  # it may be waiting for its pages
                    self.table.remove(entry.engine_rid)
        # Hello: being seen is all it does

    def _admit(self, ident: bytes, req: proto.GenRequest) -> None:
        if self.drain.active:
            self._send(ident, proto.encode_err(req.rid, ErrorCode.CAPACITY, DRAINING_MESSAGE, True))
            return
        if self.table.find(ident, req.rid) is not None:
            self._send(ident, proto.encode_err(req.rid, ErrorCode.BAD_REQUEST, "duplicate request id", False))
            return
        try:
            sampling = SamplingParams.from_dict(req.sampling)
        except RequestError as exc:
            self._send(ident, proto.encode_err(req.rid, exc.code, exc.message, exc.retryable))
            return
        except (TypeError, ValueError) as exc:
            self._send(ident, proto.encode_err(req.rid, ErrorCode.BAD_REQUEST, f"bad sampling: {exc}", False))
            return
        entry = self.table.add(ident, req.rid, req.deadline, time.monotonic())
        if req.prefill is not None:  # disaggregated: pages come from the hinted prefill worker
            local_reason = self.decode.start(entry, req, sampling)
            if local_reason is None:
                return
            DISAGG_FALLBACKS.labels(local_reason).inc()
        self._add_to_engine(entry, req, req.tokens.tolist(), sampling, req.resumed)

    def _add_to_engine(self, entry: InFlight, req: GenRequest, tokens: list[int], sampling: SamplingParams,
                       resumed: int) -> bool:
        """Hand an admitted request to the engine; False (the gateway told why) when the engine refuses it."""
        try:  # the engine validates sampling against the vocabulary, token ids and the context length
            self.engine.add_request(entry.engine_rid, tokens, sampling, req.priority, req.ns, req.fkey,
                                    req.weight, resumed, req.ttft_deadline)
            self.metrics.admitted(entry.engine_rid, req.fkey or req.ns)
            self.spans.admitted(entry.engine_rid, req.traceparent)
            if self._promises is not None:  # gateways learn the placement now, not after the prefill
                self._promises.promise(entry.engine_rid, req.ns, tokens)
            return True
        except RequestError as exc:
            self.table.remove(entry.engine_rid)
            self._send(entry.ident, proto.encode_err(req.rid, exc.code, exc.message, exc.retryable))
        except Exception:
            log.exception("internal error admitting request %s", req.rid, extra={"request_id": req.rid})
            self.table.remove(entry.engine_rid)
            self._send(entry.ident, proto.encode_err(req.rid, ErrorCode.INTERNAL,
                                                     "internal error admitting the request", True))
        return False

    def _deliver(self, entry: InFlight, item: OutItem) -> None:
        """Send one request's output outside a step (a disaggregated request's first token)."""
        if item.finish_reason is not None:
            self.table.remove(entry.engine_rid)
        self._send(entry.ident, proto.encode_out([item], time.time()))

    def _step(self) -> None:
        started = time.monotonic()
        if self._pulse is not None and self._last_stats:
            self._pulse.arm(self._last_stats, self.table.live_gateways(), self._next_stats)
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; ending its %d requests", len(self.table))
            self._end_all(ErrorCode.INTERNAL, "internal error in the engine step", retryable=True)
            time.sleep(0.05)  # no hot spin should the engine keep failing
            return
        finally:
            if self._pulse is not None:
                self._pulse.disarm()
        self.spans.stepped(outputs, started)  # first: it reads the timing the metrics drop at a first output
        self.metrics.stepped(outputs, started)
        if self.prefill.jobs:
            outputs = self.prefill.stepped(outputs)  # pages and first tokens go to decode workers
        per_gateway: dict[bytes, list[OutItem]] = {}
        table = self.table
        for out in outputs:
            entry = table.get(out.rid)
            if entry is None:
                continue  # ended here already (deadline, gateway gone)
            if out.error is not None:
                table.remove(out.rid)
                error = out.error
                self._send(entry.ident, proto.encode_err(entry.rid, error.code, error.message,
                                                         error.retryable))
                continue
            if out.finish_reason is not None:
                table.remove(out.rid)
            elif not out.new_tokens:
                continue
            item = OutItem(entry.rid, out.new_tokens, out.finish_reason, out.cached_tokens, out.logprobs,
                           top_ids=out.top_ids, top_logprobs=out.top_logprobs)
            per_gateway.setdefault(entry.ident, []).append(item)
        sent_at = time.time()
        for ident, items in per_gateway.items():
            self._send(ident, proto.encode_out(items, sent_at))

    # ------------------------------------------------------------ housekeeping

    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
        for gw in self.table.expired_gateways(now, self.config.gateway_timeout):
            if gw.engine_rids:
                log.warning("gateway %r silent for %.1fs: ending its %d requests with a retryable error",
                            gw.ident[:64], self.config.gateway_timeout, len(gw.engine_rids))
            for engine_rid in list(gw.engine_rids):
                self._abandon(engine_rid)
        for entry in self.table.past_deadline(time.time()):
            log.info("request %s passed its deadline", entry.rid, extra={"request_id": entry.rid})
            self._end(entry, ErrorCode.CAPACITY, "deadline exceeded", retryable=True)
        if self.decode.leases or self.decode.links.links:
            self.decode.housekeeping(now)
        self._trim.maybe_trim(now)
        self._memory_report.maybe_report(now)
        self.spans.forget_gone()

    def _abandon(self, engine_rid: str) -> None:
        """Stop a request whose gateway (or decode peer) fell silent, and tell it so: back, it resumes the
        stream (gateway) or prefills locally (decode peer) at once, not after a timeout or lease."""
        entry = self.table.get(engine_rid)
        if entry is None:
            return
        if self.prefill.owns(engine_rid):
            self._abort_quietly(engine_rid)
            self._send_parts(entry.ident, [proto.encode_kv_error(
                entry.rid, "error", "the prefill worker stopped waiting for the decode worker (silent)")])
            return
        self._end(entry, ErrorCode.ABANDONED, "the worker stopped waiting for this gateway (silent)", True)

    def _abort_quietly(self, engine_rid: str) -> None:
        """Stop a request whose owner will hear nothing more about it (its final output is ignored)."""
        self.table.remove(engine_rid)
        self.prefill.forget(engine_rid)
        self.decode.cancel(engine_rid)
        try:
            self.engine.abort(engine_rid)
        except Exception:
            log.exception("engine abort failed for engine request %s", engine_rid)

    def _end(self, entry: InFlight, code: ErrorCode, message: str, retryable: bool) -> None:
        self._abort_quietly(entry.engine_rid)
        self._send(entry.ident, proto.encode_err(entry.rid, code, message, retryable))

    def _end_all(self, code: ErrorCode, message: str, retryable: bool) -> None:
        for entry in self.table:
            self._end(entry, code, message, retryable)

    # ------------------------------------------------------------ sending

    def _send(self, ident: bytes, payload: bytes) -> None:
        self._send_parts(ident, [payload])

    def _send_parts(self, ident: bytes, parts: list) -> None:
        """One message to `ident`; large parts (page rows) go without a copy."""
        try:
            self.sock.send_multipart([ident, *parts], zmq.NOBLOCK, copy=len(parts) == 1)
        except zmq.Again:
            log.warning("gateway %r is not reading (queue full): frame dropped", ident[:64])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._gateway_unreachable(ident)

    def _gateway_unreachable(self, ident: bytes) -> None:
        gw = self.table.gateways.pop(ident, None)
        if gw is not None and gw.engine_rids:
            log.warning("gateway %r disconnected: aborting its %d requests", ident[:64], len(gw.engine_rids))
            for engine_rid in list(gw.engine_rids):
                self._abort_quietly(engine_rid)

    def _stats_frame(self, snapshot: bool = False) -> bytes:
        """Stats with the next batch of block changes; `snapshot`: with every block held (one gateway's)."""
        if self._promises is not None:
            self._promises.settle(lambda rid: self.table.get(rid) is not None)
        return stats_frame(self.engine, self.worker_id, self.drain.active, self.config.role, snapshot)

    def _send_stats(self) -> None:
        self._next_stats = time.monotonic() + self.config.stats_interval
        self.metrics.refresh()
        frame = self._last_stats = self._stats_frame()
        for ident in self.table.live_gateways():
            self._send(ident, frame)

    def _send_stats_to(self, ident: bytes) -> None:
        self._send(ident, self._stats_frame(snapshot=True))
