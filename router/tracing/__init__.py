"""OpenTelemetry spans for each request (router/tracing/spans.py says which), exported over OTLP."""

from __future__ import annotations

from router.tracing.config import TracingConfig
from router.tracing.spans import NULL_TRACING, Tracing


def start_tracing(config: TracingConfig) -> Tracing:
    """The tracer the configuration asks for: the null one when tracing is off."""
    if not config.enabled():
        return NULL_TRACING
    from router.tracing.otel import OtelTracing  # the SDK and an exporter load only when spans are exported

    return OtelTracing(config)
