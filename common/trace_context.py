"""Trace context across processes: the W3C `traceparent` a `gen` frame may carry, and the one tracer
provider the gateway, router and worker record spans with (none installed: tracing is off and costs one
attribute read).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT_LEN = 55  # version 00: "00-" + 32 hex trace id + "-" + 16 hex span id + "-" + 2 hex flags
TRACEPARENT_RE = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_PROPAGATOR = TraceContextTextMapPropagator()


class _State:
    provider: trace.TracerProvider | None = None


def set_tracer_provider(provider: trace.TracerProvider | None) -> None:
    """Record spans with `provider` from now on (None: tracing off). The composition root calls it once."""
    _State.provider = provider


def tracer(name: str) -> trace.Tracer | None:
    """A tracer of the installed provider, or None when tracing is off (callers skip all span work)."""
    provider = _State.provider
    return None if provider is None else provider.get_tracer(name)


def valid_traceparent(value: str) -> bool:
    return len(value) == TRACEPARENT_LEN and TRACEPARENT_RE.fullmatch(value) is not None


def extract(headers: Mapping[str, str]) -> Context | None:
    """The remote parent a request's `traceparent` header names (None without a valid one)."""
    value = headers.get("traceparent", "")
    if not valid_traceparent(value):
        return None
    return _PROPAGATOR.extract({"traceparent": value})


def traceparent(span: trace.Span) -> str:
    """The `traceparent` naming `span` as the parent of work in another process."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def parent_context(value: str) -> Context | None:
    """The context a `gen` frame's `traceparent` names, for the worker's spans (None: not traced)."""
    return _PROPAGATOR.extract({"traceparent": value}) if valid_traceparent(value) else None
