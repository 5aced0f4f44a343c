"""Clients that hold what they asked for without using it: one that stops reading its stream, one that leaves
while queued for a slot. Neither may keep a slot, an instance's place or an engine's request."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

from aiohttp import web

from kvroute.processes import running_router
from tests.conftest import metric, sample
from tests.support.fake_upstreams import healthy, only_instance, serving
from tests.support.waiting import eventually

EVENT = b"data: " + json.dumps({"choices": [{"text": "x" * 65_000}]}).encode() + b"\n\n"
FLOOD_EVENTS = 2_000  # ~130 MB: far more than the sockets' buffers hold


def _request(port: int, prompt: str, stream: bool = True) -> socket.socket:
    """A raw client that sends its request and reads nothing yet."""
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "stream": stream}).encode()
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return client


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_frees_its_slot(tmp_path: Path) -> None:
    ended: list[float] = []

    async def flood(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for _ in range(FLOOD_EVENTS):
                await response.write(EVENT)
        except (ConnectionError, RuntimeError):  # the router closed it: the engine would abort the request
            ended.append(time.monotonic())
        return response

    with serving(healthy, flood) as upstream:
        config = only_instance("flood", upstream) | {"limits": {"send_timeout_s": 1}}
        with running_router(config, tmp_path) as url:
            client = _request(_port(url), "flood")
            assert client.recv(4096).startswith(b"HTTP/1.1 200")  # then it reads nothing more
            deadline = time.monotonic() + 15
            while (
                metric(url, "kvroute_instance_in_flight", vllm_instance="flood")
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            assert metric(url, "kvroute_instance_in_flight", vllm_instance="flood") == 0
            assert metric(url, "kvroute_client_errors_total", code="send_timeout") == 1
            while not ended and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ended, "the upstream request stayed open after the client was cut off"
            client.close()


def test_a_client_that_leaves_while_queued_is_never_sent_upstream(tmp_path: Path) -> None:
    received: list[str] = []
    release = threading.Event()

    async def held(request: web.Request) -> web.Response:
        received.append(prompt := json.loads(await request.read())["prompt"])
        if prompt == "first":  # holds the router's only slot until released
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 20)
        return web.json_response({"choices": [{"text": "ok"}]})

    with serving(healthy, held) as upstream:
        config = only_instance("held", upstream) | {"admission": {"max_in_flight": 1, "queue_timeout_s": 20}}
        with running_router(config, tmp_path) as url:
            holder = _request(_port(url), "first", stream=False)
            eventually(lambda: received == ["first"])
            queued = _request(_port(url), "queued", stream=False)
            eventually(lambda: metric(url, "kvroute_admission_waiting") == 1)
            queued.close()  # gone while waiting for the slot
            eventually(lambda: (sample(url, "kvroute_client_errors_total", code="client_closed") or 0) == 1)
            release.set()
            assert holder.recv(4096).startswith(b"HTTP/1.1 200")
            holder.close()
            # Queued requests go in order: one still queued would reach the instance before this one.
            after = _request(_port(url), "after", stream=False)
            assert after.recv(4096).startswith(b"HTTP/1.1 200")
            after.close()
            assert received == ["first", "after"]
