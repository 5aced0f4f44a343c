"""A request's spans made with the OpenTelemetry SDK and exported over OTLP in batches, on the SDK's thread.

The router's own tracer provider, not the global one: nothing else in the process starts exporting. Spans are
parented explicitly, never through the ambient context, so concurrent requests on the loop cannot mix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING

from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.errors import OpenAIError
from router.tracing.config import OtlpProtocol, TracingConfig
from router.tracing.spans import NULL_TRACE, Attribute, Decision, NullTrace, Outcome
from router.worker_threads import leave_signals_to_the_main_thread

if TYPE_CHECKING:
    from router.upstreams.instances import Instance

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
_ERROR = Status(StatusCode.ERROR)
CLOSE_WITHIN_S = 2.0


class OtelTracing:
    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        """exporter: instead of the OTLP one the configuration names (tests)."""
        if exporter is None:
            protocol = config.resolved_protocol()
            exporter = _otlp_exporter(protocol, config.exporter_endpoint(protocol))
        resource = Resource.create({SERVICE_NAME: config.resolved_service_name()})
        sampler = ParentBased(TraceIdRatioBased(config.sampling_ratio))
        # Shut down by close() alone: the SDK's own at exit would wait for the exporter again, unbounded.
        self._provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
        # The batch's delay and size: the SDK's defaults, or OTEL_BSP_* from the environment.
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("kvroute")

    def request(self, name: str, headers: Mapping[str, str]) -> _Span | NullTrace:
        parent = _PROPAGATOR.extract(headers)
        span = self._tracer.start_span(name, parent, kind=SpanKind.SERVER)
        if not span.is_recording():  # not sampled: the client's own context goes on to the engine
            return NULL_TRACE
        return _Span(self._tracer, span)

    def close(self) -> None:
        """Export the spans still held, for at most CLOSE_WITHIN_S: an exporter retrying a collector that is
        gone (with backoff, up to its own 10 s timeout) must not hold the router's exit. What it has not
        exported by then is lost with the process, whose exit does not wait for the daemon thread."""
        closing = threading.Thread(target=self._shut_down, name="kvroute-tracing-close", daemon=True)
        closing.start()
        closing.join(CLOSE_WITHIN_S)

    def _shut_down(self) -> None:
        leave_signals_to_the_main_thread()
        self._provider.shutdown()


class _Span:
    __slots__ = ("_attempt", "_context", "_open", "_span", "_tracer")

    def __init__(self, tracer: otel.Tracer, span: otel.Span) -> None:
        self._tracer, self._span = tracer, span
        self._context: Context | None = None
        self._attempt: _Span | None = None  # the latest attempt, ended with this span if it was not before
        self._open = True

    def _parent(self) -> Context:
        if self._context is None:
            self._context = otel.set_span_in_context(self._span)
        return self._context

    def step(self, name: str) -> _Span:
        return _Span(self._tracer, self._tracer.start_span(name, self._parent()))

    def attempt(self, instance: Instance, retry: int, leg: str) -> _Span:
        attributes: dict[str, Attribute] = {
            "kvroute.instance": instance.name,
            "kvroute.instance.url": instance.url,
            "kvroute.retry": retry,
            "kvroute.leg": leg,
        }
        span = self._tracer.start_span("attempt", self._parent(), SpanKind.CLIENT, attributes)
        self._attempt = _Span(self._tracer, span)
        return self._attempt

    def queued(self, seconds: float, objective: str) -> None:
        started = time.time_ns() - int(seconds * 1e9)
        attributes: dict[str, Attribute] = {
            "kvroute.objective": objective,
            "kvroute.queued_ms": seconds * 1000,
        }
        self._tracer.start_span("queue", self._parent(), attributes=attributes, start_time=started).end()

    def parsed(self, model: str, policy: str, streamed: bool) -> None:
        attributes: dict[str, Attribute] = {
            "kvroute.model": model,
            "kvroute.policy": policy,
            "kvroute.stream": streamed,
        }
        self._span.set_attributes(attributes)

    def decided(self, decision: Decision, policy: str) -> None:
        reused = decision.reused
        attributes: dict[str, Attribute] = {
            "kvroute.instance": decision.instance.name,
            "kvroute.policy": policy,
            "kvroute.prompt_tokens": decision.prompt_tokens,
            "kvroute.prompt_blocks": decision.prompt_blocks,
            "kvroute.cached_blocks": decision.cached_blocks,
            "kvroute.cached_blocks.gpu": reused.gpu,
            "kvroute.cached_blocks.cpu": reused.cpu,
            "kvroute.cached_blocks.pool": reused.pool,
            "kvroute.uncached_tokens": decision.uncached_tokens,
            "kvroute.predicted_ttft_ms": decision.predicted_ttft_s * 1000,
        }
        self._span.set_attributes(attributes)

    def headers(self, forwarded: dict[str, str]) -> dict[str, str]:
        carrier = {k: v for k, v in forwarded.items() if k not in _TRACE_HEADERS}
        _PROPAGATOR.inject(carrier, self._parent())
        return carrier

    def set(self, key: str, value: Attribute) -> None:
        self._span.set_attribute(key, value)

    def failed(self, error: BaseException) -> None:
        span = self._span
        if isinstance(error, OpenAIError):
            span.set_attributes({"error.type": str(error.code), "http.response.status_code": error.status})
            if error.status < 500:  # the client's mistake or a refusal: not the router's failure
                return
        else:
            span.set_attribute("error.type", type(error).__name__)
        span.set_status(_ERROR)

    def sent(self, kind: str, status: int) -> None:
        span = self._span
        if status:
            span.set_attribute("http.response.status_code", status)
        if kind != "answered":
            span.set_attribute("error.type", kind)
        elif status >= 400:
            span.set_attribute("error.type", str(status))
        else:
            return
        span.set_status(_ERROR)

    def finished(self, outcome: Outcome) -> None:
        ended = _ended_as(outcome)
        attempt = self._attempt
        for span in (self._span,) if attempt is None else (attempt._span, self._span):
            span.set_attribute("http.response.status_code", outcome.status)
            if ended is not None:
                span.set_attribute("error.type", ended)
                span.set_status(_ERROR)
        self._span.set_attributes(
            {"kvroute.instance": outcome.instance.name, "kvroute.attempts": outcome.attempts}
        )
        if outcome.prefill_instance is not None:
            self._span.set_attribute("kvroute.prefill_instance", outcome.prefill_instance)
        self.end()

    def end(self) -> None:
        if self._open:
            self._open = False
            if self._attempt is not None:
                self._attempt.end()
            self._span.end()

    def __enter__(self) -> _Span:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if error is not None:
            self.failed(error)
        self.end()


def _ended_as(outcome: Outcome) -> str | None:
    """What went wrong with an answer that began: None when nothing did."""
    if outcome.cut:
        return "shutting_down"
    if outcome.broken:
        return "stream_broken"
    if outcome.engine_error:
        return "engine_error"
    if outcome.status >= 500:
        return str(outcome.status)
    return None


def _otlp_exporter(protocol: OtlpProtocol, endpoint: str | None) -> SpanExporter:
    """The exporter of the protocol, imported only then (each pulls its transport in)."""
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return Grpc(endpoint=endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http(endpoint=endpoint)
    except ImportError as error:
        raise RuntimeError(
            f"tracing: the OTLP exporter does not import ({error}). When what is missing is in "
            "opentelemetry.proto, xds-protos, installed after it, overwrote its files with an older copy: "
            "run scripts/own_otel_proto.sh with this Python"
        ) from error
