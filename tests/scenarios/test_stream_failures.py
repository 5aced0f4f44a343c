"""Streams whose instance fails: before the first chunk the request moves to another instance; after it, the
stream ends with an SSE error event and `data: [DONE]`, never a hang or a silent cut."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from kvroute.processes import FleetPorts, running_router
from tests.conftest import metric, sample
from tests.support.fake_upstreams import first_in_config, healthy, serving
from tests.support.http import post

STREAM = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
ROUND_ROBIN = {"x-kvroute-policy": "round-robin"}
CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'


def _streaming(*writes: bytes, then_s: float, dies: bool, last: bytes = b"") -> Iterator[int]:
    """A fake instance that sends a stream's headers at once, as vLLM does, then writes, waits then_s and
    dies (closes the connection) or writes last and ends; yields its port."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in writes:
            await response.write(data)
        await asyncio.sleep(then_s)
        if last:
            await response.write(last)
        if dies:
            assert request.transport is not None
            request.transport.close()
        return response

    with serving(healthy, stream) as port:
        yield port


@pytest.fixture
def dies_before_first_chunk() -> Iterator[int]:
    """Dies while prefilling."""
    yield from _streaming(then_s=0, dies=True)


@pytest.fixture
def stalls_after_first_chunk() -> Iterator[int]:
    """Sends one chunk, then nothing for 5 s (a wedged engine)."""
    yield from _streaming(CHUNK, then_s=5, dies=False)


@pytest.fixture
def pauses_after_first_chunk() -> Iterator[int]:
    """Sends one chunk, pauses 1.5 s (a long tool-call argument being parsed, say), then the rest."""
    yield from _streaming(CHUNK, then_s=1.5, dies=False, last=CHUNK + b"data: [DONE]\n\n")


@pytest.fixture
def never_starts() -> Iterator[int]:
    """Sends the stream's headers and nothing for 5 s (a prefill stuck in a queue)."""
    yield from _streaming(then_s=5, dies=False)


@pytest.fixture
def dies_mid_event() -> Iterator[int]:
    """Sends one chunk, then half of the next event, and dies."""
    yield from _streaming(CHUNK, CHUNK[:40], then_s=0.1, dies=True)


def _first_alone(fleet: FleetPorts, name: str, port: int, **upstream: float) -> dict[str, object]:
    """The fake instance first, with upstream settings, under round robin: the first request goes to it."""
    config = first_in_config(fleet, name, port, upstream=upstream)
    config["default_policy"] = "round-robin"
    return config


def test_a_stream_whose_instance_dies_before_its_first_chunk_is_served_elsewhere(
    dies_before_first_chunk: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    with running_router(first_in_config(fleet, "dying", dies_before_first_chunk), tmp_path) as url:
        for _ in range(4):  # round robin: the dying instance is tried first at least once
            status, headers, payload = post(url + "/v1/completions", STREAM, ROUND_ROBIN)
            assert status == 200
            assert headers["x-kvroute-instance"] != "dying"
            events = [e for e in payload.split(b"\n\n") if e.strip()]
            assert events[-1] == b"data: [DONE]" and len(events) == 4  # three tokens, all of them
        assert metric(url, "kvroute_retries_total", vllm_instance="dying") >= 1


def test_a_stream_idle_past_its_timeout_ends_with_an_error_event_and_done(
    stalls_after_first_chunk: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    config = _first_alone(fleet, "stalling", stalls_after_first_chunk, stream_idle_timeout_s=0.5)
    with running_router(config, tmp_path) as url:
        started = time.monotonic()
        status, headers, payload = post(url + "/v1/completions", STREAM)
        elapsed = time.monotonic() - started
        assert status == 200 and headers["x-kvroute-instance"] == "stalling"
        events = [e for e in payload.split(b"\n\n") if e.strip()]
        assert events[0] == CHUNK.strip()
        error = json.loads(events[1].removeprefix(b"data: "))["error"]
        assert error["code"] == "stream_broken"
        assert events[2] == b"data: [DONE]"
        assert elapsed < 4, "the router waited for the upstream instead of its idle timeout"
        assert metric(url, "kvroute_upstream_errors_total", vllm_instance="stalling", kind="stream_idle") == 1


def test_a_pause_between_chunks_within_the_idle_timeout_is_not_held_to_the_first_byte_timeout(
    pauses_after_first_chunk: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    config = _first_alone(
        fleet, "pausing", pauses_after_first_chunk, first_byte_timeout_s=0.5, stream_idle_timeout_s=4
    )
    with running_router(config, tmp_path) as url:
        status, headers, payload = post(url + "/v1/completions", STREAM)
        assert status == 200 and headers["x-kvroute-instance"] == "pausing"
        events = [e for e in payload.split(b"\n\n") if e.strip()]
        assert events == [CHUNK.strip(), CHUNK.strip(), b"data: [DONE]"]
        assert sample(url, "kvroute_upstream_errors_total", vllm_instance="pausing") is None


def test_a_stream_without_a_first_chunk_within_its_timeout_fails_as_a_timeout(
    never_starts: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    config = _first_alone(fleet, "silent", never_starts, first_byte_timeout_s=0.5, stream_idle_timeout_s=30)
    with running_router(config, tmp_path) as url:
        started = time.monotonic()
        status, headers, payload = post(url + "/v1/completions", STREAM, {"x-request-id": "slow-1"})
        assert time.monotonic() - started < 4, "the router waited past first_byte_timeout_s"
        assert status == 504 and b"upstream_timeout" in payload, payload  # a gateway timeout, not a crash
        assert headers["x-kvroute-attempts"] == "1" and headers["x-request-id"] == "slow-1"
        assert metric(url, "kvroute_upstream_errors_total", vllm_instance="silent", kind="timeout") == 1


def test_a_stream_broken_mid_event_drops_the_half_event_before_the_error_event(
    dies_mid_event: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    config = first_in_config(fleet, "dying", dies_mid_event)
    config["default_policy"] = "round-robin"
    with running_router(config, tmp_path) as url:
        status, headers, payload = post(url + "/v1/completions", STREAM)
        assert status == 200 and headers["x-kvroute-instance"] == "dying"
        events = [e for e in payload.split(b"\n\n") if e.strip()]
        assert events[0] == CHUNK.strip()
        assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "stream_broken", events
        assert events[2:] == [b"data: [DONE]"]


_stream_of = contextlib.contextmanager(_streaming)


def _error_event(code: int) -> bytes:
    error = {
        "message": "failed",
        "type": "InternalServerError" if code >= 500 else "BadRequestError",
        "param": None,
        "code": code,
    }
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


@pytest.mark.parametrize(("code", "failures"), [(500, 1), (400, 0)])
def test_an_engine_error_event_mid_stream_counts_against_the_instance_a_refusal_does_not(
    fleet: FleetPorts, tmp_path: Path, code: int, failures: int
) -> None:
    """vLLM reports a failure after a stream began as an error event; one of the client's making (4xx)
    says nothing against the instance, else a client could open its circuit breaker."""
    with _stream_of(CHUNK, _error_event(code), b"data: [DONE]\n\n", then_s=0, dies=False) as port:
        config = _first_alone(fleet, "erring", port) | {"circuit_breaker": {"failures": 1}}
        with running_router(config, tmp_path) as url:
            status, _, payload = post(url + "/v1/completions", STREAM)
            assert status == 200 and payload == CHUNK + _error_event(code) + b"data: [DONE]\n\n"  # as sent
            assert (
                sample(url, "kvroute_upstream_errors_total", vllm_instance="erring", kind="stream_error") or 0
            ) == failures
            assert (sample(url, "kvroute_circuit_opens_total", vllm_instance="erring") or 0) == failures


def test_a_stream_answered_whole_is_relayed_whole(fleet: FleetPorts, tmp_path: Path) -> None:
    """A gateway in front of an engine may answer a stream request with one JSON body: all of it reaches
    the client, not its first chunk."""
    whole = json.dumps({"choices": [{"text": "y" * 2_000_000}]}).encode()

    async def answer_whole(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=whole, content_type="application/json")

    with serving(healthy, answer_whole) as port:
        with running_router(_first_alone(fleet, "whole", port), tmp_path) as url:
            status, _, payload = post(url + "/v1/completions", STREAM)
            assert status == 200 and payload == whole
