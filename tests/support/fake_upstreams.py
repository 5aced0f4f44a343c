"""Hand-made upstreams that fail in exact ways a real engine can: served from a thread on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web

from kvroute.processes import FleetPorts, free_port_block

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def healthy(request: web.Request) -> web.Response:
    return web.Response()


async def answering(request: web.Request) -> web.Response:
    """A completion answered at once, whole."""
    await request.read()
    return web.json_response({"choices": [{"text": "ok"}]})


def only_instance(name: str, port: int) -> dict[str, object]:
    """A router configuration whose one instance, name, is the fake on port. A fake reports no model path
    (/v1/models root) and has no /tokenize: the router tokenizes with the test model's tokenizer."""
    return {
        "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],
        "instances": [{"name": name, "url": f"http://127.0.0.1:{port}"}],
    }


def first_in_config(fleet: FleetPorts, name: str, port: int, **extra: object) -> dict[str, object]:
    """The fleet's router configuration with the fake instance name on port put first."""
    config = fleet.router_config(**extra)
    instances = config["instances"]
    assert isinstance(instances, list)
    instances.insert(0, {"name": name, "url": f"http://127.0.0.1:{port}"})
    return config


@contextlib.contextmanager
def serving(
    health: Handler, completions: Handler, host: str = "127.0.0.1", path: str = "/v1/completions"
) -> Iterator[int]:
    """A fake instance on its own loop and thread: GET /health and POST path; yields its port."""
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post(path, completions)
    with serving_app(app, host) as port:
        yield port


@contextlib.contextmanager
def serving_app(app: web.Application, host: str = "127.0.0.1") -> Iterator[int]:
    """app on its own loop and thread, on a free port of host; yields the port."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    port = free_port_block(1)
    loop.run_until_complete(web.TCPSite(runner, host, port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()
