"""An engine that misbehaves at the byte level, as no well-made HTTP server would let a test: headers the
router cannot re-encode, bodies delimited by a closed connection, answers that drip or never end.

It speaks just enough HTTP/1.1 on raw sockets: GET /health is answered 200; any other request is read (its
Content-Length body) and answered with the misbehaviour the engine was made with, then the connection is
closed. It runs on its own loop and thread, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvroute.processes import free_port_block

_HEALTHY = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


@dataclass(frozen=True)
class Misbehaviour:
    """head: the status line and headers, each ending in CRLF, without the blank line; body: its parts, made
    afresh for each request (a generator may make gigabytes without holding them), written pause_s apart.
    The connection is closed after the last part, which ends a body that has neither length nor chunking."""

    head: bytes
    body: Callable[[], Iterable[bytes]]
    pause_s: float = 0.0


async def _answer(
    misbehaviour: Misbehaviour, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /health"):
            writer.write(_HEALTHY)
            return
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        writer.write(misbehaviour.head + b"\r\n")
        for part in misbehaviour.body():
            writer.write(part)
            await writer.drain()  # the router reads at its own pace; nothing piles up here
            if misbehaviour.pause_s:
                await asyncio.sleep(misbehaviour.pause_s)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the router went away first: what these tests look at is on its side
    finally:
        writer.close()


@contextlib.contextmanager
def misbehaving(misbehaviour: Misbehaviour) -> Iterator[int]:
    """The engine, serving until the block ends; yields its port."""
    loop = asyncio.new_event_loop()
    port = free_port_block(1)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer(misbehaviour, reader, writer)

    server = loop.run_until_complete(asyncio.start_server(answer, "127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(_stop(server), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _stop(server: asyncio.Server) -> None:
    """No more connections, and the answers still being written end."""
    server.close()
    answering = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in answering:
        task.cancel()
    await asyncio.gather(*answering, return_exceptions=True)
