"""Tracing setup for a process: an OpenTelemetry SDK provider exporting over OTLP/HTTP when an endpoint is
set.

Nothing is installed without one, so spans cost nothing (`common.trace_context.tracer` returns None).
"""

from __future__ import annotations

import atexit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from common.trace_context import set_tracer_provider


def otlp_exporter(endpoint: str) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise SystemExit("otel_endpoint is set but the OTLP exporter is not installed: "
                         "pip install 'switchyard[otel]'") from None
    return OTLPSpanExporter(endpoint=endpoint)


def install_tracing(service_name: str, endpoint: str | None, exporter: SpanExporter | None = None) -> None:
    """Record and export this process's spans (`exporter`, else OTLP to `endpoint`); neither: tracing stays
    off. The batch processor's queue is bounded (the SDK's 2,048 spans): a slow collector drops spans, never
    blocks."""
    if exporter is None:
        if not endpoint:
            return
        exporter = otlp_exporter(endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    set_tracer_provider(provider)
    atexit.register(provider.shutdown)
