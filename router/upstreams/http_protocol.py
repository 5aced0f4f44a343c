"""The router's side of a client's HTTP/1 connection: uvicorn's httptools protocol, with what it lacks in
front of clients it does not control. What the parser refuses is answered in OpenAI's error shape; a
request's head must arrive in time, and within a size; an HTTP/1.0 client's stream is delimited by the
connection's end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ClassVar

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from router.errors import MALFORMED_HTTP, error_json

HEADER_TIMEOUT = "header_timeout"  # the code of the 408 for a head begun and not ended in time
HEADERS_TOO_LARGE = "headers_too_large"  # the code of the 431 for a head past its size
_MALFORMED_MESSAGE = "The request is not valid HTTP/1.1: its request line, headers or framing are malformed."
_EARLY_S = 0.01  # a deadline this close is reached: uvloop's clock counts milliseconds
# A chunk's size line and the line end after its data ("ffffffff\r\n", "\r\n"), with room to spare: a body
# sent in one-byte chunks is framing five times over, and is no flood of trailers.
_CHUNK_FRAMING_BYTES = 32


def connection_protocol(
    header_timeout_s: float, refused: Callable[[str], None], max_head_bytes: int
) -> type[HttpToolsProtocol]:
    """RouterProtocol with these limits. refused: told the code of each answer it gives before any app sees
    the request (a 400 for malformed HTTP, a 408 for a head too slow, a 431 for one too large)."""
    settings = {"header_timeout_s": header_timeout_s, "max_head_bytes": max_head_bytes}
    return type(
        "RouterProtocol", (RouterProtocol,), {**settings, "refused": staticmethod(refused), "__slots__": ()}
    )


class RouterProtocol(HttpToolsProtocol):
    """A connection must complete a request's head within header_timeout_s of opening or of its previous
    answer's end (nginx's client_header_timeout), else it is closed: silently if it sent nothing, with a 408
    if it began a head. uvicorn's keep-alive timeout still closes an idle connection sooner after an answer;
    any data unsets it, and this deadline does not move. A head (request line and headers) of more than
    max_head_bytes is answered 431 and its connection closed: uvicorn's httptools protocol keeps every header
    it is sent, and a client sent 45 MiB of them in a twentieth of a second, all held in the router's memory
    until the header timeout. A chunked body's trailers, kept the same way, get as much, and the connection
    is closed past it. Its settings are class attributes, set by connection_protocol."""

    header_timeout_s: ClassVar[float]
    max_head_bytes: ClassVar[int]
    refused: ClassVar[staticmethod[[str], None]]
    # One timer a connection, not one a request: it looks at the deadline when it fires and sets itself
    # again for what is left; a connection answering when it fires gets it back with its next wait.
    # In slots: uvicorn's instances hold 28 attributes already, and two more in their __dict__ cost
    # ~2,500 instructions a request (callgrind), every attribute read being slower.
    __slots__ = ("_head_bytes", "_head_timer", "_unbodied", "_waiting_since")
    _head_timer: asyncio.TimerHandle | None
    _waiting_since: float  # for a request's head: since the connection opened, or its last answer ended
    _head_bytes: int  # received of the head being parsed; -1 between a head's end and the next's start
    # Received after a head that was not body: a chunked body's framing (each chunk allowed some) and its
    # trailers, which uvicorn keeps as it keeps headers.
    _unbodied: int

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting_since = self.loop.time()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_deadline)

    def data_received(self, data: bytes) -> None:
        after_head = self._head_bytes < 0
        _data_received(self, data)
        # What a head is sent in counts once parsed: the data that ends one, which may carry a body, does
        # not; the data a head begins in counts whole. A head goes past the limit by one read at most.
        if self._head_bytes >= 0:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
                self._head_too_large()
        elif after_head:
            self._unbodied += len(data)
            if self._unbodied > self.max_head_bytes and not self.transport.is_closing():
                self._head_too_large()

    def on_message_begin(self) -> None:
        _message_begin(self)
        self._head_bytes = 0

    def on_body(self, body: bytes) -> None:
        self._unbodied -= len(body)
        _on_body(self, body)

    def on_chunk_header(self) -> None:
        self._unbodied -= _CHUNK_FRAMING_BYTES

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._head_timer is not None:
            self._head_timer.cancel()

    # The two below run for every request: they call uvicorn's directly, as super() builds an object.
    def on_headers_complete(self) -> None:
        self._head_bytes, self._unbodied = -1, 0
        _headers_complete(self)
        if self.scope["http_version"] == "1.0":
            self._close_delimited()

    def on_response_complete(self) -> None:
        _response_complete(self)
        if self.timeout_keep_alive_task is not None:  # armed: open, and no pipelined request started
            self._waiting_since = self.loop.time()
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_deadline)

    def _close_delimited(self) -> None:
        if self.cycle is not None and self.cycle.scope is self.scope:  # not an upgrade, which has none
            # uvicorn builds the cycle inline; its task has not begun, so it sends as this class does.
            self.cycle.__class__ = CloseDelimitedCycle

    def _head_deadline(self) -> None:
        self._head_timer = None
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.transport.is_closing():
            return  # answering: on_response_complete sets it again
        left = self._waiting_since + self.header_timeout_s - self.loop.time()
        if left > _EARLY_S:
            self._head_timer = self.loop.call_later(left, self._head_deadline)
            return
        # on_message_begin makes a new scope at a head's first byte; the cycle takes it once it is whole.
        if self.scope is not None and (cycle is None or cycle.scope is not self.scope):
            message = f"The request's head did not arrive within {self.header_timeout_s:g} s."
            self._refuse(b"408 Request Timeout", message, HEADER_TIMEOUT)
        self.transport.close()

    def _head_too_large(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # trailers, or a pipelined head: no answer
            self.refused(HEADERS_TOO_LARGE)  # can go now; the request in flight sees its client leave
        else:
            message = (
                f"The request's head (request line and headers) is larger than {self.max_head_bytes} bytes."
            )
            self._refuse(b"431 Request Header Fields Too Large", message, HEADERS_TOO_LARGE)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._refuse(b"400 Bad Request", _MALFORMED_MESSAGE, MALFORMED_HTTP)
        self.transport.close()

    def _refuse(self, status: bytes, message: str, code: str) -> None:
        """An answer in OpenAI's error shape, before any app saw the request, counted by its code."""
        self.refused(code)
        body = error_json(message, "invalid_request_error", code)
        self.transport.write(_error_answer(status, body, self.server_state.default_headers))


_headers_complete = HttpToolsProtocol.on_headers_complete
_data_received = HttpToolsProtocol.data_received
_message_begin = HttpToolsProtocol.on_message_begin
_on_body = HttpToolsProtocol.on_body
_response_complete = HttpToolsProtocol.on_response_complete


def _error_answer(status: bytes, body: bytes, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    head = [b"HTTP/1.1 " + status + b"\r\n"]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


class CloseDelimitedCycle(RequestResponseCycle):
    """An HTTP/1.0 request's exchange. HTTP/1.0 has no chunked coding: an answer of no stated length (a
    stream) goes as it comes and ends with the connection (RFC 9112, 6.3); uvicorn would chunk it, and the
    client would read the chunks' sizes as data. uvicorn keeps no HTTP/1.0 connection alive: it says
    connection: close, and closes after the answer, whatever the request's Connection header asked."""

    _close_delimited = False

    async def send(self, message: ASGISendEvent) -> None:
        if message["type"] == "http.response.start":
            headers = message["headers"] = list(message.get("headers", ()))  # read twice: not an iterator
            self._close_delimited = self._unframed(message["status"], headers)
            if self._close_delimited:
                self.chunked_encoding = False  # nor content-length: uvicorn adds no framing
        elif message["type"] == "http.response.body" and self._close_delimited:
            self.expected_content_length = len(message.get("body", b""))  # all that uvicorn checks
        await super().send(message)

    def _unframed(self, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
        if self.response_started or self.scope["method"] == "HEAD" or status in (204, 304):
            return False
        framing = (b"content-length", b"transfer-encoding")
        return not any(name.lower() in framing for name, _ in headers)
