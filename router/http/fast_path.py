"""POST /v1/chat/completions and /v1/completions straight to the proxy, past FastAPI.

FastAPI's middleware stack, routing and dependency solving cost more per request than kvroute's routing
decision (py-spy, docs/bench-overhead.md). The two OpenAI routes are still declared on the app (for its
OpenAPI schema); this wrapper, outside the app, answers them before FastAPI sees them. Errors other than
OpenAIError reach the server, which answers 500 as FastAPI would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import OpenAIError
from router.prompt.openai_body import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from router.http.proxy import Proxy

Forward = Callable[["Proxy", Request], Awaitable[Response]]
ROUTES: dict[str, Forward] = {
    "/v1/chat/completions": lambda proxy, req: proxy.forward(req, "/v1/chat/completions", ChatRequest),
    "/v1/completions": lambda proxy, req: proxy.forward(req, "/v1/completions", CompletionRequest),
}


class OpenAIFastPath:
    def __init__(
        self, app: ASGIApp, proxy: Callable[[], Proxy], rejected: Callable[[OpenAIError], None]
    ) -> None:
        """rejected: told of every request answered with an error the proxy raised."""
        self.app, self._proxy, self._rejected = app, proxy, rejected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        forward = ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if forward is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await forward(self._proxy(), Request(scope, receive))
        except OpenAIError as error:
            self._rejected(error)
            response = error.response()
        # The client's id on every answer, the router's own errors too, so that its logs can find them (the
        # engine's own echo, with vLLM's --enable-request-id-headers, is passed on as it is).
        request_id = Headers(scope=scope).get("x-request-id")
        if request_id is not None and "x-request-id" not in response.headers:
            response.headers["x-request-id"] = request_id
        await response(scope, receive, send)
