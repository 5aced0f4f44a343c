"""The HTTP stack kvroute serves and proxies with: one place for its settings, which the benchmark's plain
pass-through (kvroute/bench/overhead/plain_proxy.py) uses too, so that it measures the same stack minus the
routing."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import aiohttp
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.errors import MALFORMED_HTTP, error_json

_MALFORMED_MESSAGE = "The request is not valid HTTP/1.1: its request line, headers or framing are malformed."


def freeze_startup_objects() -> None:
    """What start-up built (tokenizers, transformers, pydantic, FastAPI) lives as long as the process, yet
    every full collection walks it, stalling every request in flight for ~150 ms: keep it out of the
    collector's sight, and collect the young generations less often than per 700 allocations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def json_errors_protocol(refused: Callable[[], None]) -> type[HttpToolsProtocol]:
    """httptools refuses malformed HTTP (a bad Content-Length, both Content-Length and Transfer-Encoding,
    control bytes in a header) before any app sees the request, and uvicorn answers it in plain text; an
    OpenAI client reads error bodies as JSON, so the answer is OpenAI's error object. refused counts them."""

    class JsonErrorsProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            refused()
            body = error_json(_MALFORMED_MESSAGE, "invalid_request_error", MALFORMED_HTTP)
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
            ]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    return JsonErrorsProtocol


def server_config(
    app: Any, host: str, port: int, malformed_http: Callable[[], None] = lambda: None, **options: Any
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=json_errors_protocol(malformed_http),
        access_log=False,
        log_level="warning",
        proxy_headers=False,  # nothing reads the client address; X-Forwarded-* is not trusted
        server_header=False,
        **options,
    )


def upstream_session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    """Bodies are relayed as they come, so nothing asks upstreams to compress."""
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, skip_auto_headers=("Accept-Encoding", "User-Agent")
    )
