"""The floor under any Python router: a plain FastAPI + aiohttp pass-through, for ``kvroute bench overhead``.

It forwards each OpenAI POST, body untouched, to the next backend in turn and returns the answer: no parsing,
no tokenization, no routing decision, no metrics. It runs on the same server stack as kvroute (uvicorn with
uvloop and httptools, no access log), so the gap between it and kvroute is what routing costs, and the gap
between it and vllm-router is what Python's HTTP stack costs. Run as
``python -m kvroute.plain_proxy --port PORT URL [URL ...]``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from fastapi import FastAPI, Request, Response

_FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions")


def plain_proxy_app(upstreams: Sequence[str]) -> FastAPI:
    turns = itertools.cycle([url.rstrip("/") for url in upstreams])
    session: aiohttp.ClientSession | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal session
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await session.close()

    app = FastAPI(lifespan=lifespan)

    async def forward(request: Request) -> Response:
        assert session is not None
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with session.post(next(turns) + request.url.path, data=body, headers=headers) as answer:
            content = await answer.read()
            return Response(content, answer.status, media_type=answer.content_type)

    for path in _FORWARDED_PATHS:
        app.add_api_route(path, forward, methods=["POST"])
    app.add_api_route("/health", lambda: Response(), methods=["GET"])
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("upstreams", nargs="+", help="backend base URLs, taken in turn")
    args = parser.parse_args(argv)
    uvicorn.run(
        plain_proxy_app(args.upstreams), host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
        access_log=False, log_level="warning",
    )  # fmt: skip


if __name__ == "__main__":
    main()
