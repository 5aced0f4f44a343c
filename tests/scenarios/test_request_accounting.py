"""What a request costs and how it is counted: a slow body holds no slot, a stream its client left is not an
answer, and the time of an attempt that failed is part of what the client waited."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

from aiohttp import web

from kvroute.processes import running_router
from tests.conftest import metric, sample
from tests.support.fake_upstreams import answering, healthy, only_instance, serving
from tests.support.http import post

BODY = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()


def _start_slow_body(url: str) -> socket.socket:
    """A client that sends its headers and one byte of a 1,000-byte body, then nothing."""
    host, port = url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    return client


def test_a_client_slow_to_send_its_body_holds_no_slot_and_gets_a_408(tmp_path: Path) -> None:
    with serving(healthy, answering) as port:
        config = {
            **only_instance("i0", port),
            "admission": {"max_in_flight": 1, "queue_timeout_s": 1},
            "limits": {"body_timeout_s": 2},
        }
        with running_router(config, tmp_path) as url:
            slow = _start_slow_body(url)
            try:
                time.sleep(0.3)
                status, _, payload = post(url + "/v1/completions", BODY)
                assert status == 200, payload  # the one slot was free
                slow.settimeout(5)
                answer = b""
                while b"}}" not in answer:  # headers and body may come in separate reads
                    received = slow.recv(4096)
                    assert received, answer
                    answer += received
            finally:
                slow.close()
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b'"code":"body_timeout"' in answer


async def _slow_stream(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    try:
        for n in range(30):
            await response.write(f'data: {{"choices": [{{"text": "{n}"}}]}}\n\n'.encode())
            await asyncio.sleep(0.1)
        await response.write(b"data: [DONE]\n\n")
    except ConnectionResetError:  # the router closed it: its client left
        pass
    return response


def test_a_stream_its_client_left_is_counted_as_closed_not_as_an_answer(tmp_path: Path) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 30, "stream": True}).encode()
    with serving(healthy, _slow_stream) as port, running_router(only_instance("i0", port), tmp_path) as url:
        host, router_port = url.removeprefix("http://").split(":")
        for _ in range(2):
            with socket.create_connection((host, int(router_port))) as client:
                client.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                received = b""
                while b"data: " not in received:  # its first chunk came; then it leaves
                    received += client.recv(4096)
        status, _, _ = post(url + "/v1/completions", body)  # one stream read to its end
        assert status == 200
        time.sleep(0.5)
        labels = {"policy": "kvroute", "vllm_instance": "i0"}
        assert metric(url, "kvroute_requests_total", status="499", **labels) == 2
        assert metric(url, "kvroute_requests_total", status="200", **labels) == 1
        assert metric(url, "kvroute_request_duration_seconds_count", policy="kvroute") == 1


def test_a_stream_answered_whole_is_an_answer(tmp_path: Path) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": "hi", "stream": True}).encode()
    with serving(healthy, answering) as port, running_router(only_instance("i0", port), tmp_path) as url:
        assert post(url + "/v1/completions", body)[0] == 200
        labels = {"policy": "kvroute", "vllm_instance": "i0"}
        assert metric(url, "kvroute_requests_total", status="200", **labels) == 1


async def _drop_after_a_second(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(1)
    assert request.transport is not None
    request.transport.close()
    return web.Response()


def test_the_time_to_first_byte_counts_the_attempt_that_failed_before_it(tmp_path: Path) -> None:
    with serving(healthy, _drop_after_a_second) as dropper, serving(healthy, answering) as fine:
        config = {
            "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],  # fakes: no root
            "instances": [
                {"name": "dropper", "url": f"http://127.0.0.1:{dropper}"},
                {"name": "fine", "url": f"http://127.0.0.1:{fine}"},
            ],
            "health": {"interval_s": 60},
        }
        with running_router(config, tmp_path) as url:
            status, headers, _ = post(url + "/v1/completions", BODY, {"x-kvroute-policy": "round-robin"})
            if headers["x-kvroute-attempts"] == "1":  # round robin began with the fine one
                status, headers, _ = post(url + "/v1/completions", BODY, {"x-kvroute-policy": "round-robin"})
            assert (status, headers["x-kvroute-attempts"], headers["x-kvroute-instance"]) == (
                200,
                "2",
                "fine",
            )
            assert metric(url, "kvroute_time_to_first_byte_seconds_sum", policy="round-robin") >= 1.0
            assert metric(url, "kvroute_request_duration_seconds_sum", policy="round-robin") >= 1.0


async def _lingering_stream(request: web.Request) -> web.StreamResponse:
    """A Responses stream whose engine holds the connection a while after its last event."""
    await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    try:
        await response.write(
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
        )
        completed = {"type": "response.completed", "response": {"status": "completed", "output": []}}
        await response.write(b"event: response.completed\ndata: " + json.dumps(completed).encode() + b"\n\n")
        await asyncio.sleep(2)
    except ConnectionResetError:
        pass
    return response


def test_a_client_that_leaves_after_the_last_event_had_its_whole_answer(tmp_path: Path) -> None:
    """Codex closes its connection at response.completed: the engine's end of the stream may reach the router
    later, and the answer still counts as answered, not as a client that left."""
    body = json.dumps({"model": "tiny-llama", "input": "hi", "stream": True}).encode()
    with (
        serving(healthy, _lingering_stream, path="/v1/responses") as port,
        running_router(only_instance("i0", port), tmp_path) as url,
    ):
        host, router_port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(router_port))) as client:
            client.sendall(
                b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            client.settimeout(10)
            received = b""
            while b"event: response.completed" not in received:
                chunk = client.recv(4096)
                assert chunk, received
                received += chunk
        time.sleep(0.5)
        labels = {"policy": "kvroute", "vllm_instance": "i0", "api": "responses"}
        assert metric(url, "kvroute_requests_total", status="200", **labels) == 1
        assert (sample(url, "kvroute_requests_total", status="499", **labels) or 0) == 0
