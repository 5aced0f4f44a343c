"""The endpoint-picker protocol's wire details: what is read from Envoy's ext_proc messages and what the
answers to them hold.

The protocol is the Gateway API Inference Extension's (docs/proposals/004-endpoint-picker-protocol):
the chosen endpoints, in order, as the `x-gateway-destination-endpoint` header and the same value in the
dynamic metadata namespace `envoy.lb`; the gateway's subset hint in the filter metadata namespace
`envoy.lb.subset_hint`; the endpoint that served in `envoy.lb` on the response path. kvroute's own: the
request's key in the dynamic metadata namespace `kvroute`, which the observing and answering filters' streams
forward, so that what they see of an answer reaches the request's exchange; and the gRPC metadata that marks
a routing filter whose stream may end with the decision (STREAM_METADATA).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.errors import OpenAIError, error_json

DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"  # in DESTINATION_NAMESPACE, or a response header
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
EXCHANGE_NAMESPACE = "kvroute"
EXCHANGE_KEY = "exchange"
# gRPC metadata a gateway's ext_proc filter sends (its grpc_service's initial_metadata): `route` marks the
# routing filter whose answer phases other filters follow, so the picker may end that stream once it decided.
STREAM_METADATA = "kvroute-stream"
ROUTING_ONLY = "route"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# Envoy takes a body back in pieces of up to 64 KiB in full-duplex mode; the GIE's picker keeps under it.
BODY_CHUNK_BYTES = 62_000


@functools.lru_cache(maxsize=4096)  # asked of the chosen instance and its fallbacks, every request
def endpoint(url: str) -> str:
    """An instance's `ip:port` (IPv6 in brackets), as the gateway connects to it, from its configured URL."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def header_map(headers: Any) -> dict[str, str]:
    """An ext_proc HeaderMap as a dict of lower-case names (Envoy sends raw_value, older ones value)."""
    return {
        h.key.lower(): raw.decode("utf-8", "replace") if (raw := h.raw_value) else h.value
        for h in headers.headers
    }


def subset_hint(request: Any) -> frozenset[str] | None:
    """The endpoints the gateway allows for this request; None when it sets no hint (all of them)."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())


def served_endpoint(request: Any, headers: Mapping[str, str]) -> str | None:
    """The endpoint that served a response: the protocol's metadata if the gateway sets it, else the header a
    standalone Envoy's route adds (configs/envoy-epp.yaml); None when neither names one (Envoy answered)."""
    namespace = request.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is not None and SERVED_KEY in namespace.fields:
        served = str(namespace.fields[SERVED_KEY].string_value)
    else:
        served = headers.get(SERVED_KEY, "")
    return served if served and served != "-" else None


def exchange_key(request: Any) -> str | None:
    """The routing stream an observing stream's message is about (None: not one the picker routed)."""
    namespace = request.metadata_context.filter_metadata.get(EXCHANGE_NAMESPACE)
    if namespace is None or EXCHANGE_KEY not in namespace.fields:
        return None
    return str(namespace.fields[EXCHANGE_KEY].string_value) or None


def routing_only(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a stream's gRPC metadata marks it routing only (STREAM_METADATA)."""
    return any(key == STREAM_METADATA and value == ROUTING_ONLY for key, value in metadata or ())


def full_duplex(request: Any) -> tuple[bool, bool]:
    """Whether the request body and the response body come in full-duplex mode, where the bodies pass
    through the picker and must be sent back (Envoy says so in its first message of a stream)."""
    config = request.protocol_config
    return config.request_body_mode == FULL_DUPLEX, config.response_body_mode == FULL_DUPLEX


def routed(
    endpoints: Sequence[str], body: bytes | None, end: bool = True, exchange: str | None = None
) -> list[Any]:
    """The answer that sends a request to endpoints[0], then to the others in order: the headers' answer
    with the header and the dynamic metadata (with exchange, the routing stream's key, in kvroute's
    namespace), and, in full-duplex mode (body not None), the body given back (end: all of it; trailers
    follow otherwise). In buffered mode the same mutation answers the body message instead
    (as_body_answer)."""
    value = ",".join(endpoints)
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_KEY: value}})
    if exchange is not None:
        metadata.update({EXCHANGE_NAMESPACE: {EXCHANGE_KEY: exchange}})
    common = ext_proc.CommonResponse(
        header_mutation=ext_proc.HeaderMutation(set_headers=[_header(DESTINATION_KEY, value)]),
    )
    answer = ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=metadata
    )
    return [answer, *([] if body is None else streamed_body(body, request=True, end=end))]


def as_body_answer(answer: Any, body: bytes | None) -> Any:
    """A headers' answer (routed) as the answer to a buffered body, whose headers are not sent yet and may
    still change; body: the body to send instead of the one received (None: unchanged)."""
    common = ext_proc.CommonResponse()
    common.CopyFrom(answer.request_headers.response)
    if body is not None:
        common.body_mutation.body = body
    return ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=answer.dynamic_metadata
    )


def streamed_body(body: bytes, request: bool, end: bool) -> list[Any]:
    """body given back in full-duplex mode, in pieces Envoy takes; end: it is the last of the body."""
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    answers = []
    for number, piece in enumerate(pieces, 1):
        streamed = ext_proc.StreamedBodyResponse(body=piece, end_of_stream=end and number == len(pieces))
        response = ext_proc.BodyResponse(
            response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=streamed))
        )
        answers.append(
            ext_proc.ProcessingResponse(request_body=response)
            if request
            else ext_proc.ProcessingResponse(response_body=response)
        )
    return answers


def immediate(error: OpenAIError) -> Any:
    """The gateway answers the client itself with error, in OpenAI's shape (a 503 without endpoint, a 429
    from admission, a 4xx for a bad body)."""
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in error.headers.items()}}
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=ext_proc.HeaderMutation(set_headers=[_header(k, v) for k, v in headers.items()]),
            body=error_json(error.message, error.kind, error.code, error.param),
            details=f"kvroute_{error.code}",
        )
    )


def passed(phase: str) -> Any:
    """Go on unchanged: the answer to a message of phase (a ProcessingRequest field name) that changes
    nothing."""
    if phase in ("request_headers", "response_headers"):
        return ext_proc.ProcessingResponse(**{phase: ext_proc.HeadersResponse()})
    if phase in ("request_body", "response_body"):
        return ext_proc.ProcessingResponse(**{phase: ext_proc.BodyResponse()})
    return ext_proc.ProcessingResponse(**{phase: ext_proc.TrailersResponse()})


def response_headers(add: Mapping[str, str], remove: Iterable[str]) -> Any:
    """The answer to the response's headers: add (kvroute's debug headers) set, remove taken out."""
    mutation = ext_proc.HeaderMutation(
        set_headers=[_header(k, v) for k, v in add.items()], remove_headers=list(remove)
    )
    return ext_proc.ProcessingResponse(
        response_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(header_mutation=mutation))
    )


def _header(name: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
