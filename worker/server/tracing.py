"""The worker's spans of a traced request: queue, prefill and decode, children of the gateway's `route` span
(the `gen` frame's traceparent). Times come from the loop; spans are made when the request ends, never per token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.context import Context

from worker.engine.core import Engine
from worker.engine.outputs import StepOutput
from worker.protocol.trace_context import parent_context, tracer

MAX_TRACED = 4096  # traced requests followed at once; more are served untraced


@dataclass(slots=True)
class _Traced:
    parent: Context
    admitted_ns: int
    prefill_ns: int = 0  # first step that scheduled it; 0 until then
    first_ns: int = 0  # end of the step that sampled its first token
    tokens: int = 0


class RequestSpans:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tracer = tracer("switchyard.worker")
        self._live: dict[str, _Traced] = {}
        self._unscheduled = 0
        self._offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> wall clock, for span times

    def _wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def admitted(self, engine_rid: str, traceparent: str) -> None:
        if self._tracer is None or not traceparent or len(self._live) >= MAX_TRACED:
            return
        parent = parent_context(traceparent)
        if parent is not None:
            self._live[engine_rid] = _Traced(parent, time.time_ns())
            self._unscheduled += 1

    def stepped(self, outputs: Sequence[StepOutput], started: float) -> None:
        """After an engine step that began at `started` (time.monotonic())."""
        if not self._live:
            return
        start_ns, end_ns = self._wall_ns(started), time.time_ns()
        if self._unscheduled:
            self._mark_scheduled(start_ns)
        live = self._live
        for out in outputs:
            t = live.get(out.rid)
            if t is None:
                continue
            if out.new_tokens:
                if not t.first_ns:
                    t.first_ns = end_ns
                t.tokens += len(out.new_tokens)
            if out.finish_reason is not None or out.error is not None:
                del live[out.rid]
                self._emit(t, end_ns, out)

    def forget_gone(self) -> None:
        """Drop requests that left the engine without an output (aborted with their gateway; not per step)."""
        for rid in [r for r in self._live if not self.engine.is_running(r)]:
            if self._live.pop(rid).prefill_ns == 0:
                self._unscheduled -= 1

    def _mark_scheduled(self, start_ns: int) -> None:
        waiting = {seq.rid for seq in self.engine.scheduler.waiting}
        for rid, t in self._live.items():
            if t.prefill_ns == 0 and rid not in waiting:
                t.prefill_ns = start_ns
                self._unscheduled -= 1

    def _emit(self, t: _Traced, end_ns: int, out: StepOutput) -> None:
        assert self._tracer is not None
        if t.prefill_ns == 0:
            self._unscheduled -= 1
            t.prefill_ns = end_ns
        tr, parent = self._tracer, t.parent
        tr.start_span("worker.queue", context=parent, start_time=t.admitted_ns).end(end_time=t.prefill_ns)
        prefill_end = t.first_ns or end_ns
        tr.start_span("worker.prefill", context=parent, start_time=t.prefill_ns,
                      attributes={"switchyard.cached_tokens": out.cached_tokens}).end(end_time=prefill_end)
        attributes: dict[str, str | int] = {"switchyard.completion_tokens": t.tokens,
                                            "switchyard.finish_reason": out.finish_reason or "error"}
        if out.error is not None:
            attributes["switchyard.error_code"] = str(out.error.code)
        if t.first_ns:
            tr.start_span("worker.decode", context=parent, start_time=t.first_ns,
                          attributes=attributes).end(end_time=end_ns)
