"""SIGTERM to `kvroute epp` (a real process) while a one-filter stream is open, as a Gateway API Inference
Extension gateway holds it to the request's end: gRPC health says NOT_SERVING, a new stream is refused, the
open one is still served to its end, and the picker exits once it has, well before its grace."""

from __future__ import annotations

import json
import queue
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.processes import FleetPorts
from tests.router.epp.conftest import picker_config, running_picker

GRACE_S = 60.0
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def request_headers() -> Any:
    """A chat request's headers, its body to follow in full-duplex mode."""
    headers = base_pb2.HeaderMap()
    for key, value in (
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-type", "application/json"),
    ):
        headers.headers.add(key=key, raw_value=value.encode())
    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=headers),
        protocol_config=ext_proc.ProtocolConfiguration(request_body_mode=duplex),
    )


def request_body() -> Any:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)
    )


def response_headers() -> Any:
    headers = base_pb2.HeaderMap()
    headers.headers.add(key=":status", raw_value=b"200")
    return ext_proc.ProcessingRequest(
        response_headers=ext_proc.HttpHeaders(headers=headers, end_of_stream=True)
    )


def sent(messages: queue.Queue[Any]) -> Iterator[Any]:
    while (message := messages.get(timeout=30)) is not None:
        yield message


def test_sigterm_refuses_new_streams_and_serves_the_open_one_to_its_end(
    epp_fleet: FleetPorts, tmp_path: Path
) -> None:
    config = picker_config([epp_fleet], shutdown_grace_s=GRACE_S)
    with (
        running_picker(config, tmp_path) as picker,
        grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel,
    ):
        stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        outgoing: queue.Queue[Any] = queue.Queue()
        answers = stub.Process(sent(outgoing))
        outgoing.put(request_headers())
        outgoing.put(request_body())
        routed = next(answers)  # the stream is open at the picker, its request routed
        assert routed.HasField("request_headers")
        while not next(answers).request_body.response.body_mutation.streamed_response.end_of_stream:
            pass

        picker.child.process.send_signal(signal.SIGTERM)
        asked = {"": 0, "readiness": 0}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            asked = {
                s: health.Check(health_pb2.HealthCheckRequest(service=s), timeout=5).status for s in asked
            }
            if set(asked.values()) == {NOT_SERVING}:
                break
            time.sleep(0.05)
        assert set(asked.values()) == {NOT_SERVING}, asked
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Process(iter([request_headers()])))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        outgoing.put(response_headers())  # the open stream is still served
        assert next(answers).HasField("response_headers")
        outgoing.put(None)
        assert list(answers) == []
        started = time.monotonic()
        picker.child.wait(GRACE_S / 2)  # over once its last stream is, not at its grace
        assert time.monotonic() - started < GRACE_S / 2
