"""Rejects bad input to the OpenAI endpoints before it reaches routing: too large, not JSON, not UTF-8. A body
sent with any other method (a GET's, which the router reads and never sends on) is held to the same size.

A pure ASGI middleware: only `receive` is wrapped, so streamed responses pass through untouched.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import OpenAIError, anthropic_route, bad_request, not_utf8, too_large

_GUARDED_PREFIX = "/v1/"
_JSON = "application/json"


class _Rejected(Exception):
    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


def unsupported_encoding(encoding: str) -> OpenAIError:
    return OpenAIError(
        415,
        f"Unsupported Content-Encoding {encoding!r}; send the body uncompressed.",
        "invalid_request_error",
        "unsupported_content_encoding",
    )


def unsupported_media_type(content_type: str) -> OpenAIError:
    return OpenAIError(
        415,
        f"Unsupported Content-Type {content_type or '(none)'!r}; only {_JSON} is accepted.",
        "invalid_request_error",
        "unsupported_media_type",
    )


class RequestLimits:
    """POST /v1/*: 413 over max_body_bytes (read at each request, so a reload applies), 415 unless JSON,
    400 for a body that is not UTF-8 or nests deeper than the JSON decoder can follow."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: Callable[[], int], rejected: Callable[[OpenAIError], None]
    ) -> None:
        """rejected: told of every request answered here with an error."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._rejected = rejected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes()
        posted = scope["method"] == "POST"
        error = _check_headers(scope, limit) if posted else _check_length(dict(scope["headers"]), limit)
        if error is not None:
            await self._answer(error, scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _LimitedBody(receive, limit, posted), send_tracked)
        except _Rejected as rejected:
            if started:
                raise
            await self._answer(rejected.error, scope, receive, send)
        except RecursionError:
            # msgspec gives up on JSON nested past Python's recursion limit; no real request nests so deep.
            if started:
                raise
            error = bad_request("The request body nests too deeply.", "invalid_json")
            await self._answer(error, scope, receive, send)

    async def _answer(self, error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
        self._rejected(error)
        await error.response(anthropic_route(scope["path"]))(scope, receive, send)


def _check_headers(scope: Scope, limit: int) -> OpenAIError | None:
    headers = dict(scope["headers"])
    content_type = headers.get(b"content-type", b"").decode("latin-1")
    if content_type.partition(";")[0].strip().lower() != _JSON:
        return unsupported_media_type(content_type)
    encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
    if encoding not in ("identity", ""):  # neither the router nor vLLM inflates a compressed body
        return unsupported_encoding(encoding)
    return _check_length(headers, limit)


def _check_length(headers: dict[bytes, bytes], limit: int) -> OpenAIError | None:
    length = headers.get(b"content-length")
    if length is None:
        return None
    if not length.isdigit():
        return bad_request("The Content-Length header is not a number.", "invalid_content_length")
    return too_large(limit) if int(length) > limit else None


class _LimitedBody:
    """receive, counting the body's bytes against the limit and, for a JSON body, checking they decode as
    UTF-8."""

    def __init__(self, receive: Receive, limit: int, json: bool = True) -> None:
        self._receive, self._limit, self._received = receive, limit, 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._json = json

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] != "http.request":
            return message
        chunk: bytes = message.get("body", b"")
        self._received += len(chunk)
        if self._received > self._limit:
            raise _Rejected(too_large(self._limit))
        if not self._json or (chunk.isascii() and not self._utf8.getstate()[0]):
            return message  # the common case, checked without copying the chunk
        try:
            self._utf8.decode(chunk, final=not message.get("more_body", False))
        except UnicodeDecodeError:
            raise _Rejected(not_utf8()) from None
        return message
