"""The engine behind the streaming case of ``kvroute bench overhead``: OpenAI chat and completion streams
paced by one decode step clock, as a vLLM engine emits them, for almost no CPU.

Every stream gets its first chunk as soon as its request is read (prefill takes no time here), then one chunk
per step: each step writes the next chunk of every stream at once, as a batched decode step does. A stream is
``max_tokens`` ``data:`` events (the request's, else ``--tokens``), the last with ``finish_reason``, then
``data: [DONE]``. Non-streamed requests get one canned completion. ``/health``, ``/metrics`` (empty) and
``/v1/models`` answer what the routers' health checks ask; anything else is a 404 (kvroute's tokenization
audit then counts a failed check, nothing more).

A raw asyncio protocol on httptools and uvloop: measured on 2 cores at 256 streams of 20 ms steps (12,800
chunks/s), it uses a fraction of what an aiohttp server needs for the same streams (docs/bench-overhead.md).
Run as ``python -m kvroute.bench.overhead.stream_engine --step-ms 20 PORT [PORT...]``: one process on every
port, so every stream shares one step clock however a router spreads them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Sequence
from typing import cast

import httptools
import msgspec
import uvloop

from kvroute.bench.overhead.backend import CANNED_COMPLETION, MODEL

_MODELS = msgspec.json.encode(
    {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "owned_by": "bench", "max_model_len": 1_000_000}],
    }
)
_CHAT_CHUNK = (
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny-llama",'
    '"choices":[{"index":0,"delta":{"content":" token"},"finish_reason":%s}]}'
)
_TEXT_CHUNK = (
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny-llama",'
    '"choices":[{"index":0,"text":" token","finish_reason":%s}]}'
)
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(data: str) -> bytes:
    return _chunk(f"data: {data}\n\n".encode())


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n".encode()
    return head + b"content-type: " + content_type + b"\r\n\r\n" + body


_TOKEN = {kind: _event(chunk % "null") for kind, chunk in (("chat", _CHAT_CHUNK), ("text", _TEXT_CHUNK))}
_LAST = {
    kind: _event(chunk % '"length"') + _event("[DONE]") + b"0\r\n\r\n"
    for kind, chunk in (("chat", _CHAT_CHUNK), ("text", _TEXT_CHUNK))
}
_OK = _response("200 OK", b"", b"text/plain")
_METRICS = _response("200 OK", b"", b"text/plain; version=0.0.4")
_NOT_FOUND = _response("404 Not Found", b'{"error":"not found"}')
_COMPLETION = _response("200 OK", CANNED_COMPLETION.encode())


class _Body(msgspec.Struct):
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


_decode_body = msgspec.json.Decoder(_Body).decode


class _Stream:
    __slots__ = ("kind", "left", "transport")

    def __init__(self, transport: asyncio.Transport, kind: str, left: int) -> None:
        self.transport, self.kind, self.left = transport, kind, left


class Engine:
    """The step clock and the streams it feeds."""

    def __init__(self, step_s: float, tokens: int) -> None:
        self.step_s, self.tokens = step_s, tokens
        self.streams: set[_Stream] = set()
        self._next = 0.0

    def start_stream(self, transport: asyncio.Transport, kind: str, tokens: int) -> None:
        if tokens <= 1:
            transport.write(_STREAM_HEAD + _LAST[kind])
            return
        transport.write(_STREAM_HEAD + _TOKEN[kind])
        self.streams.add(_Stream(transport, kind, tokens - 1))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._next = loop.time()
        while True:
            self._next = max(self._next + self.step_s, loop.time())
            await asyncio.sleep(self._next - loop.time())
            self.step()

    def step(self) -> None:
        done = []
        for stream in self.streams:
            if stream.transport.is_closing():
                done.append(stream)
                continue
            stream.left -= 1
            if stream.left:
                stream.transport.write(_TOKEN[stream.kind])
            else:
                stream.transport.write(_LAST[stream.kind])
                done.append(stream)
        self.streams.difference_update(done)


class _Connection(asyncio.Protocol):
    """HTTP/1.1 with keep-alive; one request at a time (a client waits for its stream to end)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url, body = self._url.partition(b"?")[0], b"".join(self._body)
        self._url, self._body = b"", []
        transport = self._transport
        if transport is None:
            return
        if url in (b"/v1/chat/completions", b"/v1/completions"):
            try:
                request = _decode_body(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                transport.write(_response("400 Bad Request", b'{"error":"invalid body"}'))
                return
            if not request.stream:
                transport.write(_COMPLETION)
                return
            tokens = request.max_completion_tokens or request.max_tokens or self._engine.tokens
            self._engine.start_stream(
                transport, "chat" if url.endswith(b"chat/completions") else "text", tokens
            )
        elif url == b"/health":
            transport.write(_OK)
        elif url == b"/metrics":
            transport.write(_METRICS)
        elif url == b"/v1/models":
            transport.write(_response("200 OK", _MODELS))
        else:
            transport.write(_NOT_FOUND)


async def serve(ports: Sequence[int], step_s: float, tokens: int, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    engine = Engine(step_s, tokens)
    servers = [
        await loop.create_server(lambda: _Connection(engine), host, port, backlog=4096) for port in ports
    ]
    try:
        await engine.run()
    finally:
        for server in servers:
            server.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="an engine that streams paced OpenAI chunks, cheaply")
    parser.add_argument("ports", type=int, nargs="+")
    parser.add_argument("--step-ms", type=float, default=20.0, help="time between tokens (default 20)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens when a request sets no max_tokens")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.ports, args.step_ms / 1000, args.tokens))


if __name__ == "__main__":
    main()
