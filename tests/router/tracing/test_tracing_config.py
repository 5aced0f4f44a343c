"""When the tracing section turns spans on, and where they go."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.tracing import start_tracing
from router.tracing.config import TracingConfig
from router.tracing.spans import NULL_TRACING

COLLECTOR = "http://collector:4318"


@pytest.mark.parametrize(
    ("endpoint", "environ", "enabled"),
    [
        (None, {}, False),
        (COLLECTOR, {}, True),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": COLLECTOR}, True),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": COLLECTOR + "/v1/traces"}, True),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
        (COLLECTOR, {"OTEL_SDK_DISABLED": "true"}, False),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": COLLECTOR, "OTEL_SDK_DISABLED": "TRUE"}, False),
        (COLLECTOR, {"OTEL_SDK_DISABLED": "false"}, True),
    ],
)
def test_spans_are_exported_only_to_an_endpoint_set_here_or_in_the_environment(
    endpoint: str | None, environ: dict[str, str], enabled: bool
) -> None:
    assert TracingConfig(endpoint=endpoint).enabled(environ) is enabled


@pytest.mark.parametrize(
    ("endpoint", "protocol", "given"),
    [
        (COLLECTOR, "http/protobuf", COLLECTOR + "/v1/traces"),
        (COLLECTOR + "/", "http/protobuf", COLLECTOR + "/v1/traces"),
        (COLLECTOR + "/v1/traces", "http/protobuf", COLLECTOR + "/v1/traces"),
        (COLLECTOR + "/otlp/traces", "http/protobuf", COLLECTOR + "/otlp/traces"),
        ("http://collector:4317", "grpc", "http://collector:4317"),
        (None, "http/protobuf", None),  # the exporter reads the environment itself
    ],
)
def test_an_http_endpoint_without_a_path_gets_the_traces_path(
    endpoint: str | None, protocol: str, given: str | None
) -> None:
    config = TracingConfig.model_validate({"endpoint": endpoint, "protocol": protocol})
    assert config.exporter_endpoint(config.resolved_protocol({})) == given


@pytest.mark.parametrize(
    ("protocol", "environ", "resolved"),
    [
        (None, {}, "http/protobuf"),
        (None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
        (
            None,
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "grpc",
        ),
        ("http/protobuf", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
    ],
)
def test_the_protocol_is_the_sections_else_the_environments(
    protocol: str | None, environ: dict[str, str], resolved: str
) -> None:
    assert TracingConfig.model_validate({"protocol": protocol}).resolved_protocol(environ) == resolved


def test_the_service_name_is_the_sections_else_the_environments_else_kvroute() -> None:
    assert TracingConfig(service_name="edge").resolved_service_name({"OTEL_SERVICE_NAME": "x"}) == "edge"
    assert TracingConfig().resolved_service_name({"OTEL_SERVICE_NAME": "x"}) == "x"
    assert TracingConfig().resolved_service_name({}) == "kvroute"


@pytest.mark.parametrize(
    "section",
    [
        {"endpoint": "collector:4318"},
        {"protocol": "http/json"},
        {"sampling_ratio": 1.5},
        {"sampling_ratio": -0.1},
        {"sampler": "always_on"},
    ],
)
def test_a_wrong_section_is_refused(section: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TracingConfig.model_validate(section)


def test_off_is_the_null_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert start_tracing(TracingConfig()) is NULL_TRACING
