"""The floor under kvroute's request path, for ``kvroute bench overhead``: the same HTTP stack, nothing else.

A pure ASGI app that forwards each OpenAI POST, body untouched, to the next backend in turn and returns the
answer whole: no parsing, tokenization, routing decision or metrics. Everything around that is kvroute's own:
the same uvicorn, garbage-collector and aiohttp session settings (router/upstreams/http_session.py), and no
FastAPI on the request path (as router/http/fast_path.py). So the gap between it and kvroute is what routing
costs, and the gap between it and vllm-router what this HTTP stack costs. Run as
``python -m kvroute.bench.overhead.plain_proxy --port PORT URL [URL ...]``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence

import aiohttp
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.upstreams.http_session import freeze_startup_objects, server_config, upstream_session

_FORWARDED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class PlainProxy:
    def __init__(self, upstreams: Sequence[str]) -> None:
        self._turns = itertools.cycle([url.rstrip("/") for url in upstreams])
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "POST" and scope["path"] in _FORWARDED_PATHS:
            response = await self._forward(Request(scope, receive))
        elif scope["method"] == "GET" and scope["path"] == "/health":
            response = Response()
        else:
            response = Response(status_code=404)
        await response(scope, receive, send)

    async def _forward(self, request: Request) -> Response:
        assert self._session is not None, "the lifespan opens the session"
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        url = next(self._turns) + request.url.path
        async with self._session.post(url, data=body, headers=headers) as answer:
            content = await answer.read()
            content_type = answer.headers.get("content-type", "application/json")
        return Response(content, answer.status, headers={"content-type": content_type})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._session = upstream_session(aiohttp.TCPConnector(limit=0, keepalive_timeout=4))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("upstreams", nargs="+", help="backend base URLs, taken in turn")
    args = parser.parse_args(argv)
    app = PlainProxy(args.upstreams)
    freeze_startup_objects()
    uvicorn.Server(server_config(app, "127.0.0.1", args.port, lifespan="on")).run()


if __name__ == "__main__":
    main()
