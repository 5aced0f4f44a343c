"""The client of the streaming case of ``kvroute bench overhead``: N concurrent streams, each chunk's arrival
timed, in a process of its own (so no other thread shares its interpreter) printing one JSON line.

Each connection (HTTP/1.1, kept alive) posts a streamed chat completion of ``--tokens`` tokens and, once its
stream has ended, the next one, until the window is over. The connections' first requests are spread over
one stream's length, so that requests keep arriving while others stream, as with continuous batching. Every
connection is streaming throughout the window, which starts once the last one began: relayed tokens/s counts
the tokens that arrived in it. Time to first byte is from the request's write to the first body byte;
inter-token latency is the time between consecutive tokens of a stream, from its second to its last (the
first interval depends on where the request fell in the engine's step, not on the path).

A raw asyncio protocol on httptools and uvloop; its own CPU time is reported with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import resource
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools
import msgspec
import uvloop


@dataclass
class StreamStats:
    """What one client run measured; latencies in milliseconds."""

    streams: int = 0  # started
    ok: int = 0  # ended with [DONE] after every token asked for
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # received, in all streams
    window_s: float = 0.0
    window_tokens: int = 0
    tokens_per_s: float = 0.0  # window_tokens / window_s
    ttfb_p50_ms: float | None = None
    ttfb_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    client_cpu_s: float = 0.0
    client_cpu_share: float = 0.0  # of one core, over the whole run


class _Failed(Exception):
    pass


class _Collector:
    def __init__(self) -> None:
        self.ttfb: list[float] = []
        self.itl: list[float] = []
        self.arrivals: list[float] = []  # every token's arrival
        self.errors: Counter[str] = Counter()
        self.streams = self.ok = 0


class _StreamProtocol(asyncio.Protocol):
    """One connection; one stream at a time. Token events are counted as they complete."""

    def __init__(self, collector: _Collector) -> None:
        self._collector = collector
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self._held = b""
        self._sent = self._first = self._last = 0.0
        self._tokens = 0
        self._finished = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, request: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self._held, self._tokens, self._first, self._finished = b"", 0, 0.0, False
        self._sent = time.perf_counter()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad HTTP: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("connection closed")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status != 200:
            self._fail(f"status {status}")

    def on_body(self, body: bytes) -> None:
        now = time.perf_counter()
        if not self._first:
            self._first = now
            self._collector.ttfb.append(now - self._sent)
        data = self._held + body if self._held else body
        events = data.split(b"\n\n")
        self._held = events.pop()
        collector = self._collector
        for event in events:
            if event.startswith(b"data: [DONE]"):
                self._finished = True
            elif b'"choices":[]' not in event:  # a usage-only chunk is not a token
                self._tokens += 1
                if self._tokens > 2:
                    collector.itl.append(now - self._last)
                self._last = now
                collector.arrivals.append(now)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _fail(self, reason: str) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(_Failed(reason))

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def tokens(self) -> int:
        return self._tokens


def request_bytes(url: str, tokens: int, tag: str) -> bytes:
    parts = urlsplit(url)
    body = msgspec.json.encode(
        {
            "model": "tiny-llama",
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"{tag} Stream an answer of {tokens} tokens, please."}],
        }
    )
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\ncontent-type: application/json\r\n"
        f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _connection(
    url: str,
    index: int,
    tokens: int,
    tag: str,
    start_at: float,
    stop_at: float,
    timeout_s: float,
    collector: _Collector,
) -> None:
    await asyncio.sleep(max(start_at - time.perf_counter(), 0))
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    protocol: _StreamProtocol | None = None
    sent = 0
    while time.perf_counter() < stop_at:
        try:
            if protocol is None or protocol.transport is None or protocol.transport.is_closing():
                _, protocol = await loop.create_connection(lambda: _StreamProtocol(collector), host, port)
            collector.streams += 1
            request = request_bytes(url, tokens, f"{tag}-{index}-{sent}")
            sent += 1
            await asyncio.wait_for(protocol.send(request), timeout_s)
            if not protocol.finished or protocol.tokens < tokens:
                raise _Failed(
                    f"ended after {protocol.tokens} tokens" + ("" if protocol.finished else ", no [DONE]")
                )
            collector.ok += 1
        except (_Failed, OSError, TimeoutError) as exc:
            collector.errors[str(exc) or type(exc).__name__] += 1
            if protocol is not None and protocol.transport is not None:
                protocol.transport.close()
            protocol = None
            await asyncio.sleep(0.05)  # a refused connection is not retried in a tight loop
    if protocol is not None and protocol.transport is not None:
        protocol.transport.close()


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest rank, of sorted values."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


async def run(
    urls: Sequence[str], streams: int, tokens: int, step_s: float, duration_s: float, tag: str
) -> StreamStats:
    """urls: connections are spread over them in turn (direct: the engine's ports, as a router spreads)."""
    collector = _Collector()
    ramp_s = tokens * step_s
    cpu_before, wall_before = _cpu(), time.perf_counter()
    t0 = wall_before + 0.05
    window = (t0 + ramp_s, t0 + ramp_s + duration_s)
    timeout_s = 30 + 4 * ramp_s
    await asyncio.gather(
        *(
            _connection(
                urls[i % len(urls)],
                i,
                tokens,
                tag,
                t0 + ramp_s * i / streams,
                window[1],
                timeout_s,
                collector,
            )
            for i in range(streams)
        )
    )
    cpu_s, wall_s = _cpu() - cpu_before, time.perf_counter() - wall_before
    ttfb, itl = sorted(collector.ttfb), sorted(collector.itl)
    in_window = sum(1 for t in collector.arrivals if window[0] <= t < window[1])

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000

    return StreamStats(
        streams=collector.streams,
        ok=collector.ok,
        failed=collector.streams - collector.ok,
        errors=dict(collector.errors),
        tokens=len(collector.arrivals),
        window_s=duration_s,
        window_tokens=in_window,
        tokens_per_s=in_window / duration_s,
        ttfb_p50_ms=ms(percentile(ttfb, 50)),
        ttfb_p99_ms=ms(percentile(ttfb, 99)),
        itl_p50_ms=ms(percentile(itl, 50)),
        itl_p99_ms=ms(percentile(itl, 99)),
        itl_max_ms=ms(itl[-1] if itl else None),
        client_cpu_s=cpu_s,
        client_cpu_share=cpu_s / wall_s if wall_s else 0.0,
    )


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="timed concurrent OpenAI streams; one JSON line of results")
    parser.add_argument("urls", nargs="+", help="full URLs (…/v1/chat/completions); connections alternate")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--step-ms", type=float, default=20.0, help="the engine's, to spread the first requests"
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of the measured window")
    parser.add_argument("--tag", default="stream")
    args = parser.parse_args(argv)
    stats = uvloop.run(
        run(args.urls, args.streams, args.tokens, args.step_ms / 1000, args.duration, args.tag)
    )
    sys.stdout.write(msgspec.json.encode(asdict(stats)).decode() + "\n")


if __name__ == "__main__":
    main()
