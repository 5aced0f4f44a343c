"""The HTTP stack kvroute serves and proxies with: one place for its settings, which the benchmark's plain
pass-through (kvroute/bench/overhead/plain_proxy.py) uses too, so that it measures the same stack minus the
routing."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import aiohttp
import uvicorn

from router.http.settings import LimitsConfig
from router.upstreams.http_protocol import connection_protocol


def freeze_startup_objects(fewer_young_collections: bool = True) -> None:
    """What start-up built (tokenizers, transformers, pydantic, FastAPI) lives as long as the process, yet
    every full collection walks it, stalling every request in flight for ~150 ms: keep it out of the
    collector's sight.

    fewer_young_collections: collect the young generations every 20,000 allocations instead of Python's 700,
    which spares `serve` CPU at 64 connections (0.27-0.28 ms a request against 0.31). Not for the endpoint
    picker: its HTTP/2 libraries leave cyclic garbage every request, which a collection that rare walks all at
    once, holding 3-5% of requests for 2-13 ms (p99 at one connection 11-13 ms, against 1.7-1.9 with
    Python's thresholds), while saving it no CPU (docs/notes/overhead-investigations.md)."""
    gc.collect()
    gc.freeze()
    if fewer_young_collections:
        gc.set_threshold(20_000, 20, 20)


def server_config(
    app: Any,
    host: str,
    port: int,
    refused_http: Callable[[str], None] = lambda code: None,
    header_timeout_s: float = LimitsConfig().header_timeout_s,
    max_header_bytes: int = LimitsConfig().max_header_bytes,
    **options: Any,
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=connection_protocol(header_timeout_s, refused_http, max_header_bytes),
        access_log=False,
        log_level="warning",
        proxy_headers=False,  # nothing reads the client address; X-Forwarded-* is not trusted
        server_header=False,
        **options,
    )


def upstream_session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    """Bodies are relayed as they come, so nothing asks upstreams to compress. No cookie jar: a cookie an
    engine, or a gateway in front of it, sets for one request would go with every later one to that host,
    whichever client sent it (a sticky-session cookie would pin the whole router's traffic)."""
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
