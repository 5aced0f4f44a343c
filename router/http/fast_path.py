"""The routed routes (router/apis/routes.py) straight to the proxy, past FastAPI.

FastAPI's middleware stack, routing and dependency solving cost more per request than kvroute's routing
decision (py-spy, docs/bench-overhead.md). The routes are still declared on the app, from the same
table (for its OpenAPI schema); this wrapper, outside the app, answers them before FastAPI sees them. Errors
other than OpenAIError reach the server, which answers 500 as FastAPI would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from router.apis.routes import routed_api
from router.errors import OpenAIError

if TYPE_CHECKING:
    from router.http.proxy import Proxy


class OpenAIFastPath:
    def __init__(
        self, app: ASGIApp, proxy: Callable[[], Proxy], rejected: Callable[[OpenAIError], None]
    ) -> None:
        """rejected: told of every request answered with an error the proxy raised."""
        self.app, self._proxy, self._rejected = app, proxy, rejected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        routed = routed_api(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if routed is None:
            await self.app(scope, receive, send)
            return
        api, stored = routed
        try:
            response = await self._proxy().forward(Request(scope, receive), scope["path"], api, stored)
        except OpenAIError as error:
            self._rejected(error)
            response = error.response(api.anthropic)
        # The client's id on every answer, the router's own errors too, so that its logs can find them (the
        # engine's own echo, with vLLM's --enable-request-id-headers, is passed on as it is).
        request_id = Headers(scope=scope).get("x-request-id")
        if request_id is not None and "x-request-id" not in response.headers:
            response.headers["x-request-id"] = request_id
        await response(scope, receive, send)
