"""Graceful shutdown: on SIGTERM the router refuses new connections, lets streams in flight finish within
`shutdown_grace_s`, ends the ones still running then with an error event and [DONE], and exits."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvroute.processes import Child, FleetPorts, free_port_block, running_fleet, start, wait_healthy

EXITED_ON_SIGTERM = 128 + signal.SIGTERM  # on its own, after the shutdown; not killed (that is -9)
DECODE_TPS = 20  # slow enough that a stream of 40 tokens lasts about 2 s


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(1)
    with running_fleet(ports, tmp_path_factory.mktemp("slow-fleet"), ["--decode-tps", str(DECODE_TPS)]):
        yield ports


def start_router(ports: FleetPorts, tmp_path: Path, grace_s: float) -> tuple[Child, str]:
    config_path = tmp_path / "router.yaml"
    config_path.write_text(yaml.safe_dump(ports.router_config(shutdown_grace_s=grace_s)))
    port = free_port_block(1)
    child = start("router", ["serve", "--config", str(config_path), "--port", str(port)], tmp_path)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(child, [url + "/metrics"])
    return child, url


def story(url: str, tokens: int, stream: bool) -> urllib.request.Request:
    body = {"model": "tiny-llama", "prompt": "tell a long story", "max_tokens": tokens, "stream": stream}
    return urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )


class Stream(threading.Thread):
    """Reads one streamed completion; `first_chunk` is set when the first event arrives."""

    def __init__(self, url: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.tokens = url, tokens
        self.first_chunk = threading.Event()
        self.events: list[bytes] = []

    def run(self) -> None:
        with urllib.request.urlopen(story(self.url, self.tokens, stream=True), timeout=30) as response:
            for line in response:
                if line.strip():
                    self.events.append(line.strip())
                    self.first_chunk.set()


def refuses_connections(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


def test_sigterm_lets_a_stream_in_flight_finish_and_refuses_new_connections(
    slow_fleet: FleetPorts, tmp_path: Path
) -> None:
    router, url = start_router(slow_fleet, tmp_path, grace_s=10)
    try:
        stream = Stream(url, tokens=40)
        stream.start()
        assert stream.first_chunk.wait(10)
        os.kill(router.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 2
        while not refuses_connections(url):
            assert time.monotonic() < deadline, "still accepting connections 2 s after SIGTERM"
            time.sleep(0.05)
        stream.join(15)
        assert not stream.is_alive()
        assert stream.events[-1] == b"data: [DONE]"
        assert not any(b'"error"' in event for event in stream.events)
        assert len(stream.events) == 41  # every token, then [DONE]
        assert router.process.wait(10) == EXITED_ON_SIGTERM
    finally:
        router.stop()


def _terminate_during(router: Child, request: threading.Thread) -> float:
    """SIGTERM the router while request runs; the seconds until request ended (it must, within 15 s)."""
    started = time.monotonic()
    os.kill(router.process.pid, signal.SIGTERM)
    request.join(15)
    assert not request.is_alive()
    return time.monotonic() - started


def test_a_stream_longer_than_the_grace_period_ends_with_an_error_event_and_done(
    slow_fleet: FleetPorts, tmp_path: Path
) -> None:
    router, url = start_router(slow_fleet, tmp_path, grace_s=1)
    try:
        stream = Stream(url, tokens=400)  # 20 s at this decode rate
        stream.start()
        assert stream.first_chunk.wait(10)
        assert _terminate_during(router, stream) < 5
        assert stream.events[-1] == b"data: [DONE]"
        error = json.loads(stream.events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "shutting_down"
        assert router.process.wait(10) == EXITED_ON_SIGTERM
    finally:
        router.stop()


class WholeAnswer(threading.Thread):
    """Asks for one completion, not streamed; keeps the status, headers and body it gets."""

    def __init__(self, url: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.tokens = url, tokens
        self.status, self.headers, self.body = 0, dict[str, str](), b""

    def run(self) -> None:
        try:
            with urllib.request.urlopen(story(self.url, self.tokens, stream=False), timeout=30) as response:
                self.status, self.headers, self.body = (
                    response.status,
                    dict(response.headers),
                    response.read(),
                )
        except urllib.error.HTTPError as error:
            self.status, self.headers, self.body = error.code, dict(error.headers), error.read()


def test_an_answer_still_computing_after_the_grace_period_is_a_503_to_retry(
    slow_fleet: FleetPorts, tmp_path: Path
) -> None:
    router, url = start_router(slow_fleet, tmp_path, grace_s=1)
    try:
        answer = WholeAnswer(url, tokens=400)  # 20 s at this decode rate
        answer.start()
        time.sleep(1)  # routed and computing
        _terminate_during(router, answer)
        assert answer.status == 503, answer.body
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["retry-after"] == "1"
        assert json.loads(answer.body)["error"]["code"] == "shutting_down"
        assert router.process.wait(10) == EXITED_ON_SIGTERM
    finally:
        router.stop()
