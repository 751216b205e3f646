"""common.otel_setup: no endpoint, no tracer (spans cost nothing); an exporter given, spans reach it with the
process's service name."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.otel_setup import install_tracing
from common.trace_context import set_tracer_provider, tracer


def test_no_endpoint_installs_nothing() -> None:
    install_tracing("switchyard-test", None)
    assert tracer("x") is None


def test_an_exporter_receives_the_spans() -> None:
    exporter = InMemorySpanExporter()
    install_tracing("switchyard-test", None, exporter=exporter)
    try:
        t = tracer("x")
        assert t is not None
        t.start_span("one").end()
        from common import trace_context

        trace_context._State.provider.force_flush()
        (span,) = exporter.get_finished_spans()
        assert span.name == "one" and span.resource.attributes["service.name"] == "switchyard-test"
    finally:
        set_tracer_provider(None)
