"""The `tracing` section: where a request's OpenTelemetry spans go (router/tracing/)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from router.settings_base import Strict

OtlpProtocol = Literal["http/protobuf", "grpc"]
DEFAULT_SERVICE_NAME = "kvroute"
# The standard variables the OpenTelemetry SDKs read: the traces' own first.
_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_TRACES_PATH = "/v1/traces"
_PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


class TracingConfig(Strict):
    """OpenTelemetry spans for each request (the request, its steps, each attempt at an instance), exported
    over OTLP; the trace context sent to the engine is the attempt's span, so vLLM's own spans
    (--otlp-traces-endpoint) join the trace. Off unless an endpoint is set, here or in the environment.
    Read at start: a reload that changes it is refused (a restart applies it)."""

    endpoint: str | None = Field(
        default=None,
        description="the OTLP collector: http/protobuf, its base URL (http://collector:4318, to which "
        "/v1/traces is added) or its traces URL; grpc, http://collector:4317; unset: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, and no tracing when neither is "
        "set (nor when OTEL_SDK_DISABLED is true)",
    )
    protocol: OtlpProtocol | None = Field(
        default=None,
        description="OTLP over http/protobuf or grpc; unset: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf",
    )
    service_name: str | None = Field(
        default=None,
        min_length=1,
        description=f"the spans' service.name; unset: OTEL_SERVICE_NAME, else {DEFAULT_SERVICE_NAME}",
    )
    sampling_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="the share of requests traced among those that arrive without a trace of their own; a "
        "client's traceparent decides for its request (sampled or not, as its flag says)",
    )

    @field_validator("endpoint")
    @classmethod
    def _url(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"{endpoint!r} is not an http:// or https:// URL")
        return endpoint

    def enabled(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Whether spans are exported: an endpoint here or in the environment, and the SDK not disabled."""
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        return self.endpoint is not None or any(environ.get(name) for name in _ENDPOINT_ENV)

    def exporter_endpoint(self, protocol: OtlpProtocol) -> str | None:
        """What the exporter is given; None: it reads the environment, as the specification says (a base
        URL gets /v1/traces, a traces URL is taken as it is)."""
        endpoint = self.endpoint
        if endpoint is None or protocol == "grpc" or urlsplit(endpoint).path not in ("", "/"):
            return endpoint
        return endpoint.rstrip("/") + _TRACES_PATH

    def resolved_protocol(self, environ: Mapping[str, str] = os.environ) -> OtlpProtocol:
        if self.protocol is not None:
            return self.protocol
        named = next((value for name in _PROTOCOL_ENV if (value := environ.get(name))), None)
        return "grpc" if named == "grpc" else "http/protobuf"

    def resolved_service_name(self, environ: Mapping[str, str] = os.environ) -> str:
        return self.service_name or environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
