"""The spans the SDK makes of what the request path tells its trace, and what they leave out."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.errors import too_many_requests, unavailable
from router.tracing.config import TracingConfig
from router.tracing.otel import OtelTracing
from router.tracing.spans import NULL_TRACE

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SAMPLED = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
UNSAMPLED = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-00"}
INSTANCE: Any = SimpleNamespace(name="i0", url="http://127.0.0.1:9")


@pytest.fixture
def exported() -> Iterator[tuple[OtelTracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = OtelTracing(TracingConfig(sampling_ratio=1.0), exporter)
    yield tracing, exporter
    tracing.close()


def _spans(tracing: OtelTracing, exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    tracing.close()  # exports what the batch holds
    return {span.name: span for span in exporter.get_finished_spans()}


@pytest.mark.parametrize(
    ("ratio", "headers", "recorded"),
    [
        (1.0, {}, True),
        (0.0, {}, False),
        (0.0, SAMPLED, True),  # the client's flag decides for its request
        (1.0, UNSAMPLED, False),
    ],
)
def test_a_request_is_traced_as_the_ratio_or_the_clients_flag_says(
    ratio: float, headers: dict[str, str], recorded: bool
) -> None:
    tracing = OtelTracing(TracingConfig(sampling_ratio=ratio), InMemorySpanExporter())
    trace = tracing.request("POST /v1/completions", headers)
    assert (trace is not NULL_TRACE) is recorded
    trace.end()
    tracing.close()


def test_an_attempts_headers_carry_its_span_and_the_clients_tracestate(
    exported: tuple[OtelTracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = exported
    root = tracing.request("POST /v1/completions", {**SAMPLED, "tracestate": "k=v"})
    attempt = root.attempt(INSTANCE, 0, "whole")
    forwarded = {"x-request-id": "r1", **SAMPLED, "tracestate": "k=v"}
    sent = attempt.headers(forwarded)
    root.end()
    spans = _spans(tracing, exporter)
    span_id = format(spans["attempt"].context.span_id, "016x")
    assert sent == {"x-request-id": "r1", "traceparent": f"00-{TRACE_ID}-{span_id}-01", "tracestate": "k=v"}
    assert (
        forwarded["traceparent"] == SAMPLED["traceparent"]
    )  # the request's own headers are left as they are


def test_the_request_ends_its_open_attempt_once_and_a_step_ends_with_its_block(
    exported: tuple[OtelTracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = exported
    root = tracing.request("POST /v1/completions", SAMPLED)
    with root.step("tokenize") as step:
        step.set("kvroute.prompt_tokens", 7)
    root.queued(0.25, "interactive")
    attempt = root.attempt(INSTANCE, 1, "whole")
    attempt.sent("answered", 200)
    root.end()
    root.end()
    attempt.end()  # all three already ended: no second end
    spans = _spans(tracing, exporter)
    assert set(spans) == {"POST /v1/completions", "tokenize", "queue", "attempt"}
    root_span, attempt_span, queue = spans["POST /v1/completions"], spans["attempt"], spans["queue"]
    assert attempt_span.end_time is not None and root_span.end_time is not None
    assert attempt_span.end_time <= root_span.end_time
    assert dict(attempt_span.attributes or {}) == {
        "kvroute.instance": "i0",
        "kvroute.instance.url": "http://127.0.0.1:9",
        "kvroute.retry": 1,
        "kvroute.leg": "whole",
        "http.response.status_code": 200,
    }
    assert queue.end_time is not None and queue.start_time is not None
    assert queue.end_time - queue.start_time == pytest.approx(0.25e9, rel=0.05)
    assert spans["tokenize"].attributes == {"kvroute.prompt_tokens": 7}


@pytest.mark.parametrize(
    ("error", "error_type", "is_error"),
    [
        (too_many_requests("full", "queue_full", 1), "queue_full", False),  # a refusal, not a failure
        (unavailable("none", "no_healthy_instance", 1), "no_healthy_instance", True),
        (ValueError("bad"), "ValueError", True),
    ],
)
def test_a_span_that_ends_in_an_error_names_it(
    exported: tuple[OtelTracing, InMemorySpanExporter], error: BaseException, error_type: str, is_error: bool
) -> None:
    tracing, exporter = exported
    root = tracing.request("POST /v1/completions", SAMPLED)
    with pytest.raises(type(error)), root.step("decide"):
        raise error
    root.end()
    decide = _spans(tracing, exporter)["decide"]
    assert (decide.attributes or {})["error.type"] == error_type
    assert (not decide.status.is_ok) is is_error


def test_the_null_trace_passes_headers_on_untouched() -> None:
    headers = {"traceparent": SAMPLED["traceparent"]}
    assert NULL_TRACE.step("x").attempt(INSTANCE, 0, "whole").headers(headers) is headers


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_an_exporter_that_does_not_import_names_the_script_that_mends_it(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = "http" if protocol == "http/protobuf" else "grpc"
    monkeypatch.setitem(sys.modules, f"opentelemetry.exporter.otlp.proto.{module}.trace_exporter", None)
    config = TracingConfig(endpoint="http://127.0.0.1:4318", protocol=protocol)
    with pytest.raises(RuntimeError, match=r"scripts/own_otel_proto\.sh"):
        OtelTracing(config)
