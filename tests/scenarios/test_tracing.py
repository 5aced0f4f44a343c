"""The router's OpenTelemetry spans, as a collector receives them over OTLP/HTTP: one trace with the client's,
the request's span beneath the client's, its steps beneath it, and the engine's traceparent naming the
attempt that reached it."""

from __future__ import annotations

import asyncio
import gzip
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvroute.processes import free_port_block, running_router, running_router_process
from router.tracing.otel import CLOSE_WITHIN_S
from tests.support.fake_upstreams import healthy, serving
from tests.support.http import post

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_HEADERS = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "k=v"}
CHAT = "/v1/chat/completions"
ROOT = f"POST {CHAT}"
SERVER, CLIENT = 2, 3  # the protocol's Span.SpanKind values


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool
    service: str


@dataclass
class Collector:
    """An OTLP/HTTP traces endpoint: every span exported to it."""

    spans: list[Span] = field(default_factory=list)

    async def traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans += [_span(s, resource.get("service.name", "")) for s in scope_spans.spans]
        answer = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type="application/x-protobuf")

    def trace(self, root: str, ends: int, timeout_s: float = 10.0) -> list[Span]:
        """The client's trace, once its root and ends attempts have come."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = [s for s in self.spans if s.trace_id == CLIENT_TRACE]
            names = [s.name for s in spans]
            if root in names and names.count("attempt") >= ends:
                return spans
            time.sleep(0.05)
        pytest.fail(f"no trace with {root} and {ends} attempts in {[s.name for s in self.spans]}")


def _span(span: Any, service: str) -> Span:
    attributes = {a.key: _value(a.value) for a in span.attributes}
    return Span(
        span.name,
        span.trace_id.hex(),
        span.span_id.hex(),
        span.parent_span_id.hex(),
        span.kind,
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        attributes,
        span.status.code == 2,  # STATUS_CODE_ERROR
        service,
    )


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value"))


@dataclass
class Engine:
    """A chat instance that records the headers it gets; it answers whole, or streamed when asked."""

    headers: list[dict[str, str]] = field(default_factory=list)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        message = {"role": "assistant", "content": "ok"}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            answer = {"id": "c1", "object": "chat.completion", "choices": [choice]}
            # A prefill leg: NixlConnector's answer names what the decode leg fetches.
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                answer["kv_transfer_params"] = {"remote_engine_id": "prefill", "remote_block_ids": [1]}
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("o", "k"):
            delta = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            event = {"id": "c1", "object": "chat.completion.chunk", "choices": [delta]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        return response


async def _drops(request: web.Request) -> web.StreamResponse:
    """An instance that breaks the connection off before answering (it died)."""
    await request.read()
    assert request.transport is not None
    request.transport.close()
    return web.Response()


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Collector, str]]:
    collector = Collector()
    with serving(healthy, collector.traces, path="/v1/traces") as port:
        for name in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_SDK_DISABLED",
        ):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the router's spans go out at once
        yield collector, f"http://127.0.0.1:{port}"


def _config(collector_url: str, model_dir: Path, *instances: tuple[str, int]) -> dict[str, object]:
    return {
        "models": [{"name": "tiny-llama", "tokenizer": str(model_dir)}],
        "instances": [{"name": name, "url": f"http://127.0.0.1:{port}"} for name, port in instances],
        # The instances are found down by requests alone, and tried in their order.
        "health": {"interval_s": 60, "unhealthy_after": 100},
        "default_policy": "round-robin",
        "tracing": {"endpoint": collector_url, "service_name": "router-under-test"},
    }


def _chat(stream: bool = False) -> bytes:
    messages = [{"role": "user", "content": "Where do the spans of a routed request go?"}]
    return json.dumps(
        {"model": "tiny-llama", "messages": messages, "max_tokens": 2, "stream": stream}
    ).encode()


def _parent_id(traceparent: str) -> tuple[str, str]:
    """A traceparent's trace id and parent span id."""
    version, trace_id, parent_id, flags = traceparent.split("-")
    assert (version, flags) == ("00", "01")
    return trace_id, parent_id


def _root(spans: list[Span]) -> Span:
    (root,) = [s for s in spans if s.name == ROOT]
    return root


def test_a_request_is_one_trace_under_the_clients_span_and_the_engine_joins_it_under_the_attempt(
    collector: tuple[Collector, str], model_dir: Path, tmp_path: Path
) -> None:
    spans, url = collector
    engine = Engine()
    with serving(healthy, engine.answer, path=CHAT) as port:
        with running_router(_config(url, model_dir, ("only", port)), tmp_path) as router:
            status, headers, payload = post(router + CHAT, _chat(), CLIENT_HEADERS)
            assert status == 200, payload
            trace = spans.trace(ROOT, ends=1)
    assert {s.trace_id for s in trace} == {CLIENT_TRACE}
    assert {s.service for s in trace} == {"router-under-test"}
    root = _root(trace)
    assert (root.parent_id, root.kind, root.error) == (CLIENT_SPAN, SERVER, False)
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["kvroute.model"] == "tiny-llama"
    assert root.attributes["kvroute.policy"] == "round-robin"
    assert root.attributes["kvroute.instance"] == "only"
    children = {s.name: s for s in trace if s.parent_id == root.span_id}
    assert set(children) == {"receive", "parse", "tokenize", "lookup", "decide", "attempt"}
    for child in children.values():
        assert root.start_ns <= child.start_ns <= child.end_ns <= root.end_ns, child.name
    assert children["tokenize"].attributes["kvroute.prompt_tokens"] > 0
    decide = children["decide"].attributes
    assert (decide["kvroute.instance"], decide["kvroute.policy"]) == ("only", "round-robin")
    assert decide["kvroute.prompt_blocks"] >= 1 and "kvroute.cached_blocks" in decide
    attempt = children["attempt"]
    assert attempt.kind == CLIENT
    assert attempt.attributes["kvroute.instance"] == "only"
    assert attempt.attributes["kvroute.retry"] == 0
    assert attempt.attributes["http.response.status_code"] == 200
    # The engine's trace context is the attempt's: its own spans are the attempt's children.
    (sent,) = engine.headers
    assert _parent_id(sent["traceparent"]) == (CLIENT_TRACE, attempt.span_id)
    assert sent["tracestate"] == "k=v"
    assert headers["x-kvroute-instance"] == "only"


def test_a_streamed_requests_span_and_its_attempt_last_until_the_stream_ends(
    collector: tuple[Collector, str], model_dir: Path, tmp_path: Path
) -> None:
    spans, url = collector
    engine = Engine()
    with serving(healthy, engine.answer, path=CHAT) as port:
        with running_router(_config(url, model_dir, ("only", port)), tmp_path) as router:
            status, _, payload = post(router + CHAT, _chat(stream=True), CLIENT_HEADERS)
            assert status == 200 and payload.endswith(b"data: [DONE]\n\n"), payload
            trace = spans.trace(ROOT, ends=1)
    root = _root(trace)
    (attempt,) = [s for s in trace if s.name == "attempt"]
    assert root.attributes["kvroute.stream"] is True
    assert root.attributes["http.response.status_code"] == 200 and not root.error
    # Two chunks 50 ms apart: the spans cover the stream, not only its first byte.
    assert attempt.end_ns - attempt.start_ns >= 90_000_000
    assert attempt.end_ns <= root.end_ns
    assert _parent_id(engine.headers[0]["traceparent"]) == (CLIENT_TRACE, attempt.span_id)


def test_an_attempt_that_fails_and_its_retry_are_two_attempt_spans(
    collector: tuple[Collector, str], model_dir: Path, tmp_path: Path
) -> None:
    spans, url = collector
    engine = Engine()
    with serving(healthy, _drops, path=CHAT) as dying, serving(healthy, engine.answer, path=CHAT) as port:
        config = _config(url, model_dir, ("dying", dying), ("alive", port))
        with running_router(config, tmp_path) as router:
            status, headers, payload = post(router + CHAT, _chat(), CLIENT_HEADERS)
            assert status == 200, payload
            assert headers["x-kvroute-attempts"] == "2"
            trace = spans.trace(ROOT, ends=2)
    root = _root(trace)
    first, second = sorted((s for s in trace if s.name == "attempt"), key=lambda s: s.start_ns)
    assert {first.parent_id, second.parent_id} == {root.span_id}
    assert (first.attributes["kvroute.instance"], first.attributes["kvroute.retry"]) == ("dying", 0)
    assert (first.attributes["error.type"], first.error) == ("dropped", True)
    assert (second.attributes["kvroute.instance"], second.attributes["kvroute.retry"]) == ("alive", 1)
    assert second.attributes["http.response.status_code"] == 200 and not second.error
    assert first.end_ns <= second.start_ns
    assert len([s for s in trace if s.name == "decide" and s.parent_id == root.span_id]) == 2
    assert _parent_id(engine.headers[0]["traceparent"]) == (CLIENT_TRACE, second.span_id)
    assert root.attributes["kvroute.attempts"] == 2 and not root.error


def test_the_spans_held_are_exported_when_the_router_stops(
    collector: tuple[Collector, str], model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spans, url = collector
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # nothing goes out before the shutdown
    engine = Engine()
    with serving(healthy, engine.answer, path=CHAT) as port:
        with running_router(_config(url, model_dir, ("only", port)), tmp_path) as router:
            assert post(router + CHAT, _chat(), CLIENT_HEADERS)[0] == 200
            time.sleep(0.3)
            assert spans.spans == []
        assert {s.name for s in spans.trace(ROOT, ends=1, timeout_s=1.0)} >= {ROOT, "decide", "attempt"}


def test_a_prefill_leg_is_a_span_with_its_decision_and_attempt_beneath(
    collector: tuple[Collector, str], model_dir: Path, tmp_path: Path
) -> None:
    spans, url = collector
    prefill, decode = Engine(), Engine()
    with serving(healthy, prefill.answer, path=CHAT) as p, serving(healthy, decode.answer, path=CHAT) as d:
        config = _config(url, model_dir, ("p", p), ("d", d))
        instances = config["instances"]
        assert isinstance(instances, list)
        instances[0]["role"], instances[1]["role"] = "prefill", "decode"
        config["disaggregation"] = {"local_prefill_max_tokens": 0}  # every prompt gets a prefill leg
        with running_router(config, tmp_path) as router:
            status, headers, payload = post(router + CHAT, _chat(), CLIENT_HEADERS)
            assert status == 200, payload
            assert headers["x-kvroute-prefill-instance"] == "p"
            trace = spans.trace(ROOT, ends=2)
    root = _root(trace)
    (leg,) = [s for s in trace if s.name == "prefill"]
    assert leg.parent_id == root.span_id and leg.attributes["kvroute.prefill_instance"] == "p"
    beneath = {s.name: s for s in trace if s.parent_id == leg.span_id}
    assert set(beneath) == {"decide", "attempt"}
    assert beneath["attempt"].attributes["kvroute.leg"] == "prefill"
    (decode_attempt,) = [s for s in trace if s.name == "attempt" and s.parent_id == root.span_id]
    assert decode_attempt.attributes["kvroute.leg"] == "decode"
    assert leg.end_ns <= decode_attempt.start_ns
    # Each engine's spans join the trace under the attempt that reached it.
    assert _parent_id(prefill.headers[0]["traceparent"]) == (CLIENT_TRACE, beneath["attempt"].span_id)
    assert _parent_id(decode.headers[0]["traceparent"]) == (CLIENT_TRACE, decode_attempt.span_id)


def test_a_collector_that_is_gone_does_not_hold_the_routers_exit(model_dir: Path, tmp_path: Path) -> None:
    """The exporter retries a refused collector with backoff for up to its 10 s timeout; SIGTERM waited for
    it (8.5 s here), where the router exits within CLOSE_WITHIN_S of its last answer without it."""
    gone = f"http://127.0.0.1:{free_port_block(1)}"  # nothing listens there
    engine = Engine()
    with serving(healthy, engine.answer, path=CHAT) as port:
        with running_router_process(_config(gone, model_dir, ("only", port)), tmp_path) as (router, child):
            assert post(router + CHAT, _chat(), CLIENT_HEADERS)[0] == 200
            answered = time.monotonic()
            child.process.send_signal(signal.SIGTERM)
            child.process.wait(timeout=30)
            took_s = time.monotonic() - answered
    assert took_s < CLOSE_WITHIN_S + 2.0, took_s
