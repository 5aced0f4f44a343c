"""What the router never does: forward the client's credentials, connect anywhere its configuration does not
name, or write prompt text to its log."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from kvroute.processes import free_port_block, running_router
from tests.support.fake_upstreams import healthy, only_instance, serving
from tests.support.http import post

MARKER = "zebra-quartz-7731"  # a word no log line would contain by chance
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Recorder:
    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    async def answer(self, request: web.Request) -> web.Response:
        await request.read()
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        answer = {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        }
        # As vLLM with --enable-request-id-headers: the client's id, or one of its own.
        return web.json_response(
            answer, headers={"X-Request-Id": request.headers.get("X-Request-Id", "engine-1")}
        )


@pytest.fixture
def recorded(tmp_path: Path) -> Iterator[tuple[str, Recorder, Path]]:
    recorder = Recorder()
    with serving(healthy, recorder.answer) as port:
        config = only_instance("only", port)
        with running_router(config, tmp_path) as url:
            yield url, recorder, tmp_path / "router.log"


class Listener(threading.Thread):
    """Counts connections to a port nothing in the configuration names."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.port = free_port_block(1)
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.sock.settimeout(0.2)
        self.accepted = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.sock.accept()[0].close()
                self.accepted += 1
            except TimeoutError:
                continue

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)
        self.sock.setblocking(False)
        while True:  # connections still in the backlog count too
            try:
                self.sock.accept()[0].close()
            except BlockingIOError:
                break
            self.accepted += 1
        self.sock.close()


def body(**fields: object) -> bytes:
    return json.dumps({"model": "tiny-llama", "prompt": f"say {MARKER}", "max_tokens": 2, **fields}).encode()


def test_client_credentials_and_hop_by_hop_headers_never_reach_the_engine(
    recorded: tuple[str, Recorder, Path],
) -> None:
    url, recorder, _ = recorded
    sent = {
        "authorization": "Bearer client-secret",
        "cookie": "session=secret",
        "proxy-authorization": "Basic c2VjcmV0",
        "x-api-key": "secret",
        "connection": "keep-alive, x-custom",
        "x-custom": "hop",
        "x-request-id": "req-42",
        "traceparent": TRACEPARENT,
        "tracestate": "k=v",
    }
    status, headers, payload = post(url + "/v1/completions", body(), sent)
    assert status == 200, payload
    (seen,) = recorder.headers
    # End-to-end headers that identify the request or carry its trace pass, and the engine's id comes back.
    assert (seen["x-request-id"], seen["traceparent"], seen["tracestate"]) == ("req-42", TRACEPARENT, "k=v")
    assert headers["x-request-id"] == "req-42"
    leaked = {
        k for k in ("authorization", "cookie", "proxy-authorization", "x-api-key", "x-custom") if k in seen
    }
    assert leaked == set()
    assert "secret" not in json.dumps(seen)


def test_no_request_makes_the_router_connect_to_an_address_it_was_not_configured_with(
    recorded: tuple[str, Recorder, Path],
) -> None:
    url, recorder, _ = recorded
    listener = Listener()
    listener.start()
    elsewhere = f"127.0.0.1:{listener.port}"
    try:
        for headers in (
            {"host": elsewhere},
            {"x-forwarded-host": elsewhere},
            {"forwarded": f"host={elsewhere}"},
            {"x-kvroute-instance": f"http://{elsewhere}"},
        ):
            assert post(url + "/v1/completions", body(), headers)[0] == 200
        assert post(url + "/v1/completions", body(model=f"http://{elsewhere}"), {})[0] == 404
        assert post(url + "/v1/completions", body(url=f"http://{elsewhere}/v1"), {})[0] == 200
        # An absolute-form request target naming another host.
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            payload = body()
            raw.sendall(
                f"POST http://{elsewhere}/v1/completions HTTP/1.1\r\nHost: {elsewhere}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            assert raw.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        listener.stop()
    assert listener.accepted == 0
    assert len(recorder.headers) == 6  # all went to the one configured instance


def test_prompt_text_is_not_logged(recorded: tuple[str, Recorder, Path]) -> None:
    url, _, log_path = recorded
    assert post(url + "/v1/completions", body(), {})[0] == 200
    assert post(url + "/v1/completions", body(stream=True), {})[0] == 200
    assert post(url + "/v1/completions", body(stream="maybe"), {})[0] == 400  # the error quotes no prompt
    assert post(url + "/v1/completions", body()[:-5], {})[0] == 400
    assert MARKER not in log_path.read_text()
