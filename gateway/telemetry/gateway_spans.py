"""The gateway's spans: one per API request, with authenticate and admission children; the router adds
`route`. A client's `traceparent` is untrusted: the request span starts a trace of its own (its own sampling
decision) and links to the client's span, unless the operator trusts clients' trace context
(`trust_client_trace`), when it is the parent. Tracing off (no provider installed): every call is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.requests import Request

from common.trace_context import extract, tracer

TRACER_NAME = "switchyard.gateway"


def start_request(request: Request, trust_client: bool = False) -> trace.Span | None:
    """The request's server span (not yet current), or None when tracing is off."""
    tr = tracer(TRACER_NAME)
    if tr is None:
        return None
    remote = extract(request.headers)
    links = []
    # a link: the client cannot opt out of sampling or pick a trace
    if remote is not None and not trust_client:
        links = [trace.Link(trace.get_current_span(remote).get_span_context())]
        remote = None
    return tr.start_span(f"{request.method} {request.url.path}", context=remote or Context(), links=links,
                         kind=SpanKind.SERVER, attributes={
                             "http.request.method": request.method, "url.path": request.url.path,
                             "switchyard.request_id": request.scope["state"]["request_id"]})


@contextlib.contextmanager
def child(name: str, **attributes: str | int | float | bool) -> Iterator[trace.Span | None]:
    """A child span of the current one for the block's duration (None and no work when tracing is off)."""
    tr = tracer(TRACER_NAME)
    if tr is None:
        yield None
        return
    # no exception event: an error message may quote the request (prompt text stays out of traces)
    with tr.start_as_current_span(name, attributes=attributes, record_exception=False,
                                  set_status_on_exception=False) as span:
        yield span


def finish(span: trace.Span | None, status: int, **attributes: str | int | float | bool) -> None:
    """End the request span once (later calls do nothing), with the response status and usage figures."""
    if span is None or not span.is_recording():
        return
    span.set_attribute("http.response.status_code", status)
    for name, value in attributes.items():
        span.set_attribute(f"switchyard.{name}", value)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()
