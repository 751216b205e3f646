"""The worker's spans of a traced request: queue, prefill and decode, children of the gateway's `route` span
(the `gen` frame's traceparent). Times come from the loop's metrics; spans are made when the request ends,
never per token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.context import Context

from common.trace_context import parent_context, tracer
from worker.engine.core import Engine
from worker.engine.records.outputs import StepOutput
from worker.server.telemetry.worker_metrics import WorkerMetrics

MAX_TRACED = 4096  # traced requests followed at once; more are served untraced


@dataclass(slots=True)
class _Traced:
    parent: Context
    admitted_ns: int = 0  # set with the first output, from WorkerMetrics.timing
    prefill_ns: int = 0
    first_ns: int = 0  # end of the step that sampled its first token; 0 until then
    tokens: int = 0


class RequestSpans:
    """Call `stepped` before `WorkerMetrics.stepped`: a request's
    timing leaves the metrics at its first output."""

    def __init__(self, engine: Engine, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._tracer = tracer("switchyard.worker")
        self._live: dict[str, _Traced] = {}
        self._offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> wall clock, for span times

    def _wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def admitted(self, engine_rid: str, traceparent: str) -> None:
        if self._tracer is None or not traceparent or len(self._live) >= MAX_TRACED:
            return
        parent = parent_context(traceparent)
        if parent is not None:
            self._live[engine_rid] = _Traced(parent)

    def stepped(self, outputs: Sequence[StepOutput], started: float) -> None:
        """After an engine step that began at `started` (time.monotonic())."""
        live = self._live
        if not live:
            return
        end_ns = time.time_ns()
        for out in outputs:
            t = live.get(out.rid)
            if t is None:
                continue
            if not t.admitted_ns:
                times = self.metrics.timing(out.rid, started)
                t.admitted_ns, t.prefill_ns = (self._wall_ns(x) for x in times) if times else (end_ns, end_ns)
            if out.new_tokens:
                t.first_ns = t.first_ns or end_ns
                t.tokens += len(out.new_tokens)
            if out.finish_reason is not None or out.error is not None:
                del live[out.rid]
                self._emit(t, end_ns, out)

    def forget_gone(self) -> None:
        """Drop requests that left the engine without an output (aborted with their gateway; not per step)."""
        for rid in [r for r in self._live if not self.engine.is_running(r)]:
            del self._live[rid]

    def _emit(self, t: _Traced, end_ns: int, out: StepOutput) -> None:
        assert self._tracer is not None
        tr, parent = self._tracer, t.parent
        tr.start_span("worker.queue", context=parent, start_time=t.admitted_ns).end(end_time=t.prefill_ns)
        tr.start_span("worker.prefill", context=parent, start_time=t.prefill_ns,
                      attributes={"switchyard.cached_tokens": out.cached_tokens}
                      ).end(end_time=t.first_ns or end_ns)
        attributes: dict[str, str | int] = {"switchyard.completion_tokens": t.tokens,
                                            "switchyard.finish_reason": out.finish_reason or "error"}
        if out.error is not None:
            attributes["switchyard.error_code"] = str(out.error.code)
        if t.first_ns:
            tr.start_span("worker.decode", context=parent, start_time=t.first_ns,
                          attributes=attributes).end(end_time=end_ns)
