"""A router in the test's own process, on uvicorn in a thread: for a test that changes the router's code
first (a registry entry, a shorter timeout) and then serves real requests through it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from kvroute.processes import free_port_block
from router.config import parse_config
from router.http.app import create_app
from router.upstreams.http_session import server_config
from tests.support.waiting import eventually


@contextlib.contextmanager
def serving(raw: dict[str, Any]) -> Iterator[str]:
    """The router of the configuration raw on a free port of 127.0.0.1; yields its URL, and stops it."""
    app = create_app(parse_config(raw))
    port = free_port_block(1)
    server = uvicorn.Server(server_config(app.asgi, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, name="router", daemon=True)
    thread.start()
    try:
        eventually(lambda: server.started, what="the router to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the router did not stop"
