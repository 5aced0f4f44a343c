"""Connections that hold a descriptor without asking for anything, and HTTP/1.0 clients: raw sockets against a
real `kvroute serve` whose limits.header_timeout_s is short."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from kvroute.processes import free_port_block, running_router, start, wait_healthy
from tests.conftest import sample
from tests.support.fake_upstreams import healthy, only_instance, serving

HEADER_TIMEOUT_S = 2.0
MARGIN_S = 6.0  # a loaded machine closes late, never early
EVENTS = [b'data: {"choices": [{"text": "%d"}]}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
SLOW_EVENT_GAP_S = 0.6  # x4 events: a stream that outlasts the header timeout


async def completions(request: web.Request) -> web.StreamResponse:
    body = json.loads(await request.read())
    if not body.get("stream"):
        return web.json_response({"choices": [{"text": "ok"}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in EVENTS:
        if body["prompt"] == "slow":
            await asyncio.sleep(SLOW_EVENT_GAP_S)
        await response.write(event)
    await response.write_eof()
    return response


def _config(port: int, header_timeout_s: float = HEADER_TIMEOUT_S) -> dict[str, object]:
    return only_instance("sse", port) | {"limits": {"header_timeout_s": header_timeout_s}}


@pytest.fixture(scope="module")
def upstream() -> Iterator[int]:
    with serving(healthy, completions) as port:
        yield port


@pytest.fixture(scope="module")
def port(upstream: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with running_router(_config(upstream), tmp_path_factory.mktemp("connection-limits")) as url:
        yield int(url.rsplit(":", 1)[1])


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=HEADER_TIMEOUT_S + MARGIN_S)


def _request(prompt: str, stream: bool, version: str = "1.1", *headers: str) -> bytes:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "stream": stream}).encode()
    lines = [f"POST /v1/completions HTTP/{version}", "Host: x", "Content-Type: application/json", *headers]
    return ("\r\n".join([*lines, f"Content-Length: {len(body)}"]) + "\r\n\r\n").encode() + body


def _until_closed(sock: socket.socket) -> bytes:
    received = b""
    # A server closing with a byte unread resets the connection: what came before it still counts.
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            received += data
    return received


def _read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One answer on a connection kept open: its head and its body, chunked or of a Content-Length."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        (int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")), None
    )
    while (len(body) < length) if length is not None else not body.endswith(b"\r\n0\r\n\r\n"):
        body += sock.recv(65536)
    return head, body


def _closed_after(sock: socket.socket, since: float) -> tuple[float, bytes]:
    """How long after since the server closed sock, and what it sent before."""
    received = _until_closed(sock)
    return time.monotonic() - since, received


def _closed_between(sock: socket.socket, before: float, after: float) -> tuple[float, float, bytes]:
    """When the server closed sock, counted from a moment before the server's clock started (the lower
    bound) and from one after it (the upper): a client on a loaded machine reads an answer late."""
    received = _until_closed(sock)
    now = time.monotonic()
    return now - before, now - after, received


def test_a_connection_that_sends_nothing_is_closed_silently(port: int) -> None:
    opened = time.monotonic()
    with _connect(port) as sock:
        after, received = _closed_after(sock, opened)
    assert received == b""
    assert HEADER_TIMEOUT_S - 0.1 <= after <= HEADER_TIMEOUT_S + MARGIN_S


def test_a_head_sent_a_byte_at_a_time_and_never_ended_is_answered_408(port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    counted = sample(url, "kvroute_client_errors_total", code="header_timeout") or 0
    opened = time.monotonic()
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        readable: list[socket.socket] = []
        while not readable and time.monotonic() - opened < HEADER_TIMEOUT_S + MARGIN_S:
            with contextlib.suppress(OSError):  # closed meanwhile: what is sent is read below
                sock.sendall(b"x")  # X-xxxx... one byte at a time, never ": value\r\n\r\n"
            readable, _, _ = select.select([sock], [], [], 0.2)
        after, received = _closed_after(sock, opened)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "header_timeout"
    assert HEADER_TIMEOUT_S - 0.1 <= after <= HEADER_TIMEOUT_S + MARGIN_S
    assert sample(url, "kvroute_client_errors_total", code="header_timeout") == counted + 1


def test_a_keep_alive_connection_outlives_the_header_timeout_while_it_asks(port: int) -> None:
    """The timeout is counted from the previous answer's end, not from the connection's start, and an answer
    that outlasts it (a slow stream) is not cut. A head begun after an answer unsets uvicorn's keep-alive
    timer; this one still ends it."""
    with _connect(port) as sock:
        for prompt, stream in [("a", False), ("slow", True), ("b", False), ("c", False), ("d", True)]:
            asked = time.monotonic()
            sock.sendall(_request(prompt, stream))
            head, body = _read_answer(sock)
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert b"[DONE]" in body if stream else json.loads(body)["choices"]
            answered = time.monotonic()
            time.sleep(HEADER_TIMEOUT_S / 4)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost:")
        since_asked, since_answered, received = _closed_between(sock, asked, answered)
    assert received.startswith(b"HTTP/1.1 408 ")
    assert since_asked >= HEADER_TIMEOUT_S - 0.1 and since_answered <= HEADER_TIMEOUT_S + MARGIN_S


def test_a_head_larger_than_max_header_bytes_is_answered_431_and_closed(port: int) -> None:
    """Two halves of 40 KiB of headers, each under the default 64 KiB, the head never ended: the second read
    takes it past the limit."""
    url = f"http://127.0.0.1:{port}"
    counted = sample(url, "kvroute_client_errors_total", code="headers_too_large") or 0
    half = b"".join(b"X-Filler-%d: %s\r\n" % (n, b"a" * 1000) for n in range(40))
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + half)
        time.sleep(0.3)
        sock.sendall(half)
        received = _until_closed(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert sample(url, "kvroute_client_errors_total", code="headers_too_large") == counted + 1


def test_a_head_under_the_limit_sent_with_a_large_body_is_served(port: int) -> None:
    """60 KiB of headers and a 400 KB body in one write: the reads that end a head, and may carry much of a
    body, do not count against the head."""
    filler = [f"X-Filler-{n}: {'a' * 1000}" for n in range(60)]
    request = _request("p" * 400_000, False, "1.1", *filler)
    with _connect(port) as sock:
        sock.sendall(request)
        head, body = _read_answer(sock)
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert json.loads(body)["choices"] == [{"text": "ok"}]


def _chunked(chunks: list[bytes], trailers: bytes = b"") -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n" + trailers + b"\r\n"


def test_a_body_in_one_byte_chunks_with_a_trailer_is_served(port: int) -> None:
    """20,000 one-byte chunks: 100 KB of framing for 20 KB of body, which is no flood of trailers."""
    body = json.dumps({"model": "tiny-llama", "prompt": "p" * 20_000, "max_tokens": 1}).encode()
    with _connect(port) as sock:
        sock.sendall(_chunked([body[i : i + 1] for i in range(len(body))], b"X-Checksum: 1\r\n"))
        head, answer = _read_answer(sock)
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert json.loads(answer)["choices"] == [{"text": "ok"}]


def test_a_flood_of_trailers_closes_the_connection(port: int) -> None:
    """uvicorn keeps a chunked body's trailers as it keeps headers: past max_header_bytes of them (and of
    framing beyond a chunk's due), the connection is closed. Counted from the read after the head's end, so
    three parts of 40 KiB, the first sent with the head."""
    url = f"http://127.0.0.1:{port}"
    counted = sample(url, "kvroute_client_errors_total", code="headers_too_large") or 0
    body = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}).encode()
    flood = b"".join(b"X-Trailer-%d: %s\r\n" % (n, b"a" * 1000) for n in range(40))
    with _connect(port) as sock:
        sock.sendall(_chunked([body])[: -len(b"\r\n")] + flood)  # trailers begun and never ended
        for _ in range(2):
            time.sleep(0.3)
            with contextlib.suppress(OSError):  # closed meanwhile
                sock.sendall(flood)
        received = _until_closed(sock)
    assert not received.startswith(b"HTTP/1.1 200 ")
    assert sample(url, "kvroute_client_errors_total", code="headers_too_large") == counted + 1


@pytest.mark.parametrize(
    ("version", "headers", "chunked"),
    [
        ("1.0", (), False),
        ("1.0", ("Connection: keep-alive",), False),  # a stream delimited by its end cannot be kept alive
        ("1.1", ("Connection: close",), True),
    ],
)
def test_an_http_1_0_stream_is_not_chunked_and_ends_at_close(
    port: int, version: str, headers: tuple[str, ...], chunked: bool
) -> None:
    with _connect(port) as sock:
        sock.sendall(_request("stream", True, version, *headers))
        received = _until_closed(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    fields = head.lower().split(b"\r\n")
    assert fields[0].startswith(b"http/1.1 200 ")
    assert b"connection: close" in fields
    assert (b"transfer-encoding: chunked" in fields) is chunked
    assert not any(field.startswith(b"content-length") for field in fields)
    if chunked:
        assert body.endswith(b"\r\n0\r\n\r\n")
    else:
        assert body == b"".join(EVENTS)


def test_an_http_1_0_whole_answer_keeps_its_content_length(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(_request("whole", False, "1.0", "Connection: keep-alive"))
        received = _until_closed(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert f"content-length: {len(body)}".encode() in head.lower().split(b"\r\n")
    assert json.loads(body)["choices"] == [{"text": "ok"}]


def test_idle_connections_no_longer_lock_out_new_clients(upstream: int, tmp_path: Path) -> None:
    """The router's descriptors limited to what it holds plus 40; 120 connections that send nothing take them
    all (the ones it cannot accept it drops); once they are closed a new client is served."""
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps(_config(upstream)))
    port = free_port_block(1)
    router = start("router", ["serve", "--config", str(config), "--port", str(port)], tmp_path)
    try:
        wait_healthy(router, [f"http://127.0.0.1:{port}/metrics"])
        descriptors = f"/proc/{router.process.pid}/fd"
        limit = len(os.listdir(descriptors)) + 40
        resource.prlimit(router.process.pid, resource.RLIMIT_NOFILE, (limit, limit))
        with contextlib.ExitStack() as idle:
            for _ in range(120):
                idle.enter_context(_connect(port))
            deadline = time.monotonic() + MARGIN_S
            while len(os.listdir(descriptors)) < limit - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(os.listdir(descriptors)) >= limit - 1, (
                "the idle connections did not take every descriptor"
            )
            assert _served_within(port, HEADER_TIMEOUT_S + MARGIN_S)
    finally:
        router.stop()


def _served_within(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with _connect(port) as sock:
                sock.sendall(_request("after", False, "1.1", "Connection: close"))
                if _until_closed(sock).startswith(b"HTTP/1.1 200 "):
                    return True
        except OSError:
            pass  # accepted and dropped for want of a descriptor, or reset
        time.sleep(0.2)
    return False


def test_an_idle_keep_alive_connection_is_still_closed_after_uvicorns_5_s(
    upstream: int, tmp_path: Path
) -> None:
    with running_router(_config(upstream, header_timeout_s=60), tmp_path) as url:
        address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        with socket.create_connection(address, timeout=5 + MARGIN_S) as sock:
            asked = time.monotonic()
            sock.sendall(_request("a", False))
            assert _read_answer(sock)[0].startswith(b"HTTP/1.1 200 ")
            since_asked, since_answered, received = _closed_between(sock, asked, time.monotonic())
    assert received == b""
    assert since_asked >= 5 - 0.1 and since_answered <= 5 + MARGIN_S
