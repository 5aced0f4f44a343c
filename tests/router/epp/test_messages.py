"""The endpoint-picker protocol's messages, built and read without Envoy."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from router.epp import messages
from router.errors import bad_request, too_many_requests, unavailable

Mode = processing_mode_pb2.ProcessingMode


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8101", "127.0.0.1:8101"),
        ("http://10.0.3.7:8000/", "10.0.3.7:8000"),
        ("http://[::1]:8000", "[::1]:8000"),
        ("http://10.0.0.5", "10.0.0.5:80"),
        ("https://10.0.0.5", "10.0.0.5:443"),
    ],
)
def test_endpoint(url: str, expected: str) -> None:
    assert messages.endpoint(url) == expected


def with_metadata(namespace: str, fields: dict[str, Any]) -> Any:
    request = ext_proc.ProcessingRequest()
    value = struct_pb2.Struct()
    value.update(fields)
    request.metadata_context.filter_metadata[namespace].CopyFrom(value)
    return request


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (ext_proc.ProcessingRequest(), None),
        (with_metadata("envoy.lb.subset_hint", {"other": 1}), None),
        (
            with_metadata("envoy.lb.subset_hint", {messages.SUBSET_KEY: ["10.0.0.1:80", "10.0.0.2:80"]}),
            frozenset({"10.0.0.1:80", "10.0.0.2:80"}),
        ),
        (with_metadata("envoy.lb.subset_hint", {messages.SUBSET_KEY: []}), frozenset()),
        (
            with_metadata("envoy.lb.subset_hint", {messages.SUBSET_KEY: "10.0.0.1:80, 10.0.0.2:80"}),
            frozenset({"10.0.0.1:80", "10.0.0.2:80"}),
        ),
        (with_metadata("envoy.lb", {messages.SUBSET_KEY: ["10.0.0.1:80"]}), None),  # another namespace
    ],
)
def test_subset_hint(request_: Any, expected: frozenset[str] | None) -> None:
    assert messages.subset_hint(request_) == expected


@pytest.mark.parametrize(
    ("request_", "headers", "expected"),
    [
        (ext_proc.ProcessingRequest(), {}, None),
        (ext_proc.ProcessingRequest(), {messages.SERVED_KEY: "10.0.0.2:80"}, "10.0.0.2:80"),
        (ext_proc.ProcessingRequest(), {messages.SERVED_KEY: "-"}, None),  # Envoy's %UPSTREAM_HOST% for none
        (
            with_metadata("envoy.lb", {messages.SERVED_KEY: "10.0.0.3:80"}),
            {messages.SERVED_KEY: "10.0.0.2:80"},
            "10.0.0.3:80",
        ),  # the protocol's metadata comes first
    ],
)
def test_served_endpoint(request_: Any, headers: dict[str, str], expected: str | None) -> None:
    assert messages.served_endpoint(request_, headers) == expected


def test_header_map_reads_raw_values_and_plain_ones() -> None:
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
            base_pb2.HeaderValue(key="X-Session-Id", value="abc"),
        ]
    )
    assert messages.header_map(headers) == {":path": "/v1/completions", "x-session-id": "abc"}


@pytest.mark.parametrize(
    ("request_mode", "response_mode", "expected"),
    [
        (Mode.FULL_DUPLEX_STREAMED, Mode.STREAMED, (True, False)),
        (Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED, (False, True)),
        (Mode.NONE, Mode.NONE, (False, False)),
    ],
)
def test_full_duplex(request_mode: int, response_mode: int, expected: tuple[bool, bool]) -> None:
    request = ext_proc.ProcessingRequest(
        protocol_config=ext_proc.ProtocolConfiguration(
            request_body_mode=request_mode, response_body_mode=response_mode
        )
    )
    assert messages.full_duplex(request) == expected


def set_headers(mutation: Any) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


@pytest.mark.parametrize(
    ("endpoints", "body", "answers"),
    [
        (["10.0.0.1:80"], None, 1),
        (["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"], b'{"x": 1}', 2),
        (["10.0.0.1:80"], b"", 2),  # an empty body still ends the stream
        (["10.0.0.1:80"], b"x" * (messages.BODY_CHUNK_BYTES * 2 + 1), 4),  # given back in pieces Envoy takes
    ],
)
def test_routed_sets_the_same_list_in_the_header_and_the_metadata(
    endpoints: list[str], body: bytes | None, answers: int
) -> None:
    routed = messages.routed(endpoints, body)
    assert len(routed) == answers
    headers = routed[0].request_headers.response
    value = ",".join(endpoints)
    assert set_headers(headers.header_mutation) == {messages.DESTINATION_KEY: value}
    assert (
        routed[0]
        .dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields[messages.DESTINATION_KEY]
        .string_value
        == value
    )
    pieces = [a.request_body.response.body_mutation.streamed_response for a in routed[1:]]
    assert b"".join(p.body for p in pieces) == (body or b"")
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True] * bool(pieces)


def test_a_buffered_body_is_answered_with_the_same_mutation() -> None:
    (headers,) = messages.routed(["10.0.0.1:80", "10.0.0.2:80"], None)
    answer = messages.as_body_answer(headers, b"{}")
    assert set_headers(answer.request_body.response.header_mutation) == {
        messages.DESTINATION_KEY: "10.0.0.1:80,10.0.0.2:80"
    }
    assert answer.request_body.response.body_mutation.body == b"{}"
    assert answer.dynamic_metadata == headers.dynamic_metadata
    unchanged = messages.as_body_answer(headers, None)
    assert not unchanged.request_body.response.HasField("body_mutation")


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (unavailable("No healthy instance.", "no_healthy_instance", 1), 503, "1"),
        (too_many_requests("At capacity.", "queue_full", 1), 429, "1"),
        (bad_request("Not JSON.", "invalid_json"), 400, None),
    ],
)
def test_immediate(error: Any, status: int, retry_after: str | None) -> None:
    answer = messages.immediate(error).immediate_response
    assert answer.status.code == status
    headers = set_headers(answer.headers)
    assert headers["content-type"] == "application/json"
    assert headers.get("retry-after") == retry_after
    body = json.loads(answer.body)
    assert body["error"]["code"] == error.code and body["error"]["message"] == error.message


@pytest.mark.parametrize(
    "phase",
    [
        "request_headers",
        "request_body",
        "request_trailers",
        "response_headers",
        "response_body",
        "response_trailers",
    ],
)
def test_passed_answers_the_phase_it_was_asked(phase: str) -> None:
    assert messages.passed(phase).WhichOneof("response") == phase


def test_response_headers_add_and_remove() -> None:
    answer = messages.response_headers({"x-kvroute-instance": "fleet-1"}, [messages.SERVED_KEY])
    mutation = answer.response_headers.response.header_mutation
    assert set_headers(mutation) == {"x-kvroute-instance": "fleet-1"}
    assert list(mutation.remove_headers) == [messages.SERVED_KEY]


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (ext_proc.ProcessingRequest(), None),
        (with_metadata("kvroute", {"other": "1"}), None),
        (with_metadata("kvroute", {messages.EXCHANGE_KEY: "17"}), "17"),
        (with_metadata("envoy.lb", {messages.EXCHANGE_KEY: "17"}), None),  # another namespace
    ],
)
def test_exchange_key(request_: Any, expected: str | None) -> None:
    assert messages.exchange_key(request_) == expected


def test_routed_names_its_exchange_for_the_observer() -> None:
    (named,) = messages.routed(["10.0.0.1:80"], None, exchange="17")
    observed = ext_proc.ProcessingRequest()
    observed.metadata_context.filter_metadata["kvroute"].CopyFrom(
        named.dynamic_metadata.fields["kvroute"].struct_value
    )
    assert messages.exchange_key(observed) == "17"
    (plain,) = messages.routed(["10.0.0.1:80"], None)
    assert "kvroute" not in plain.dynamic_metadata.fields


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        (None, False),
        ((), False),
        ((("user-agent", "envoy"),), False),
        (((messages.STREAM_METADATA, "answer"),), False),
        ((("user-agent", "envoy"), (messages.STREAM_METADATA, messages.ROUTING_ONLY)), True),
    ],
)
def test_routing_only(metadata: Any, expected: bool) -> None:
    assert messages.routing_only(metadata) is expected
