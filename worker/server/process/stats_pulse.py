"""`stats` frames: what one says of the engine, and a pulse that keeps them flowing while the server loop is
inside one long engine step.

Gateways count a silent worker as dead; a long CPU prefill chunk must not look like a crash.
"""

from __future__ import annotations

import threading
import time

import zmq

from worker import protocol as proto
from worker.engine.core import Engine
from worker.kvcache.events import kv_report


def stats_frame(engine: Engine, worker_id: str, draining: bool, role: str, snapshot: bool) -> bytes:
    """The engine's load, cache and speed as a `stats` frame, with the next batch of block changes
    (`snapshot`: every block held, for a gateway that just arrived)."""
    s = engine.stats()
    kv = kv_report(engine.cache, engine.config.block_size, engine.tokenizer_version, snapshot)
    return proto.encode_stats(proto.WorkerStats(
        worker_id=worker_id, queue=int(s.num_waiting), running=int(s.num_running),
        kv_free=int(s.kv_free_tokens), kv_total=int(s.kv_total_tokens), draining=draining,
        model=str(engine.model_id), version=proto.PROTOCOL_VERSION, kv=kv, role=role,
        hit_rate=float(s.prefix_hit_rate), prefill_tps=s.prefill_tps, step_s=s.step_s,
        prefill_backlog=s.prefill_backlog))


class StatsPulse:
    def __init__(self, sock: zmq.Socket, interval_s: float) -> None:
        self._sock = sock
        self._interval = interval_s
        self._lock = threading.Lock()  # held by the thread while it sends, and by disarm
        self._wake = threading.Condition(threading.Lock())
        self._frame: bytes | None = None
        self._idents: list[bytes] = []
        self._due_at = 0.0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="stats-pulse", daemon=True)
        self._thread.start()

    def arm(self, frame: bytes, idents: list[bytes], due_at: float | None = None) -> None:
        """Send `frame` at `due_at` (the loop's next stats time; default one interval from now), then
        every interval, until disarmed."""
        with self._wake:
            self._frame, self._idents = frame, idents
            self._due_at = time.monotonic() + self._interval if due_at is None else due_at
            self._wake.notify()

    def disarm(self) -> None:
        with self._lock, self._wake:
            self._frame = None

    def close(self) -> None:
        with self._wake:
            self._stop, self._frame = True, None
            self._wake.notify()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stop:
                    return
                if self._frame is None:
                    self._wake.wait()  # until armed or closed
                    continue
                remaining = self._due_at - time.monotonic()
                if remaining > 0:
                    self._wake.wait(remaining)  # re-armed meanwhile: look at the new due time
                    continue
                self._due_at = time.monotonic() + self._interval
            with self._lock:
                if self._frame is not None:
                    self._send(self._frame, self._idents)

    def _send(self, frame: bytes, idents: list[bytes]) -> None:
        for ident in idents:
            try:
                self._sock.send_multipart([ident, frame], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # queue full or peer gone: the server loop deals with it after the step
