"""The router's HTTP surface: OpenAI endpoints, /health and /metrics, on FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from router.apis.routes import CANCEL_RESPONSE, RETRIEVE_RESPONSE, ROUTED_PATHS, Api
from router.config import RouterConfig
from router.dispatch.observe.routing_headers import (
    ATTEMPTS_HEADER,
    CACHED_BLOCKS_HEADER,
    INSTANCE_HEADER,
    POLICY_HEADER,
    PREDICTED_TTFT_HEADER,
    PREFILL_INSTANCE_HEADER,
    PROMPT_BLOCKS_HEADER,
    WAIT_CAUSED_HEADER,
)
from router.errors import OpenAIError, anthropic_route
from router.http.admin import admin_routes, admin_token
from router.http.body_budget import BodyBudget
from router.http.cache_reset import cache_reset_routes
from router.http.client_auth import ClientAuth, client_key_digests
from router.http.dashboard import dashboard_routes
from router.http.fast_path import OpenAIFastPath
from router.http.proxy import BodyLimits, Proxy
from router.http.request_limits import RequestLimits
from router.reload import Reloader
from router.runtime import Runtime, SharedIndex
from router.upstreams.peer_sync import PeerEndpoints

log = logging.getLogger(__name__)
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# What a browser page may read of an answer besides the simple headers: when to retry, where it was routed.
_EXPOSED = [
    "retry-after",
    INSTANCE_HEADER,
    POLICY_HEADER,
    CACHED_BLOCKS_HEADER,
    PROMPT_BLOCKS_HEADER,
    PREDICTED_TTFT_HEADER,
    WAIT_CAUSED_HEADER,
    ATTEMPTS_HEADER,
    PREFILL_INSTANCE_HEADER,
    "x-request-id",
]


class RouterApp(NamedTuple):
    api: FastAPI  # every route; its state holds the proxy once the lifespan has started
    asgi: ASGIApp  # what the server runs: the request limits and the OpenAI fast path in front of api
    refused_http: Callable[[str], None]  # counts, by its code, what the server refused before the app saw it


def create_app(
    config: RouterConfig,
    path: Path | None = None,
    peers: PeerEndpoints | None = None,
    shared_index: SharedIndex | None = None,
) -> RouterApp:
    """path: the file config came from, watched and re-read on SIGHUP or POST /admin/reload; peers: its
    sibling workers' endpoints (serve --workers); shared_index: the index this router asks, when it holds none
    (router/runtime.py)."""
    runtime = Runtime(config, peers, shared_index)
    metrics = runtime.metrics
    # kvroute exports its own Prometheus metrics; FastAPI's OpenTelemetry hooks cost time on every request.
    app = FastAPI(
        title="kvroute",
        lifespan=_lifespan(runtime, config, path),
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )

    def client_error(error: OpenAIError) -> None:
        # 429s are counted where they are decided, with the router's own rejections; so are the 401s for a
        # client's API key, which never come here (router/http/client_auth.py answers them). The admin
        # token's 401 and 403 do: missing_token and wrong_token are what probing the admin API looks like.
        if error.status < 500 and error.status != 429:
            metrics.client_errors(str(error.code)).inc()

    def refused_http(code: str) -> None:
        metrics.client_errors(code).inc()

    def current_admin_token() -> str | None:
        return admin_token(runtime.config.admin)

    async def reload() -> dict[str, Any]:
        reloader: Reloader = app.state.reloader
        return await reloader.reload()

    app.include_router(admin_routes(current_admin_token, runtime, reload))
    app.include_router(dashboard_routes(runtime.upstreams, runtime, current_admin_token))
    app.include_router(cache_reset_routes(runtime.upstreams, runtime.routing_index, current_admin_token))
    _answer_errors(app, client_error)
    _serve_openai(app)
    _serve_operations(app, runtime)
    # Outside FastAPI, whose middleware stack would wrap every request and every send; the limits apply to
    # the fast path and to the app's routes alike.
    fast = OpenAIFastPath(app, proxy=lambda: app.state.proxy, rejected=client_error)
    limits = RequestLimits(
        fast, max_body_bytes=lambda: runtime.config.limits.max_body_bytes, rejected=client_error
    )
    auth = ClientAuth(limits, client_key_digests(config.auth), metrics.rejected("invalid_api_key").inc)
    if not config.cors.allow_origins:
        return RouterApp(app, auth, refused_http)
    # Outermost: a browser's preflight carries no API key, and every answer, errors too, needs the headers.
    cors = CORSMiddleware(
        auth, config.cors.allow_origins, allow_methods=["*"], allow_headers=["*"], expose_headers=_EXPOSED
    )
    return RouterApp(app, cors, refused_http)


def _lifespan(
    runtime: Runtime, config: RouterConfig, path: Path | None
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The runtime started, the proxy and the reloader in the app's state, the config file watched."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with runtime:
            limits = BodyLimits(
                lambda: runtime.config.limits.max_body_bytes,
                config.limits.body_timeout_s,
                config.limits.send_timeout_s,
            )
            bodies = BodyBudget(lambda: runtime.config.limits.max_buffered_body_bytes)
            app.state.proxy = Proxy(runtime.routing, runtime.relay, runtime.metrics, limits, bodies)
            reloader = app.state.reloader = Reloader(runtime, path)
            fleet = runtime.upstreams
            log.info(
                "routing %s to %d instances (%d answering), default policy %s; the /admin API is %s",
                ", ".join(fleet.models),
                len(fleet.instances),
                sum(i.healthy and i.failed_checks == 0 for i in fleet.instances),
                config.default_policy,
                "on" if admin_token(config.admin) is not None else "off (no admin.token)",
            )
            watch = asyncio.create_task(reloader.watch())
            try:
                yield
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

    return lifespan


def _answer_errors(app: FastAPI, client_error: Callable[[OpenAIError], None]) -> None:
    """Every error the app answers, in OpenAI's shape (Anthropic's on its routes)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        client_error(exc)
        return exc.response(anthropic_route(request.url.path))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        """An unknown route's 404 and a wrong method's 405 as vLLM answers them: {"detail": ...}."""
        headers = dict(exc.headers or {})  # a 405's Allow, say
        error = OpenAIError(exc.status_code, str(exc.detail), "invalid_request_error", str(exc.status_code))
        client_error(error)
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        error = OpenAIError(400, str(exc), "invalid_request_error", "invalid_request")
        client_error(error)
        return error.response(anthropic_route(request.url.path))


def _serve_openai(app: FastAPI) -> None:
    """The routed routes, declared for the app's OpenAPI schema (the fast path answers them first)."""
    for path, api in ROUTED_PATHS.items():
        app.add_api_route(path, _forwarded(api), methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", _forwarded(RETRIEVE_RESPONSE), methods=["GET"])
    # No id: an unknown route's 404, not a redirect to POST /v1/responses (FastAPI's for a trailing slash).
    app.add_api_route("/v1/responses/", _no_such_route, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/responses/{response_id}/cancel", _forwarded(CANCEL_RESPONSE), methods=["POST"])


async def _no_such_route(request: Request) -> Response:
    raise HTTPException(404, "Not Found")


def _forwarded(api: Api) -> Callable[[Request], Awaitable[Response]]:
    async def forward(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        return await proxy.forward(request, request.url.path, api, request.path_params.get("response_id"))

    return forward


def _serve_operations(app: FastAPI, runtime: Runtime) -> None:
    """/v1/models, /health and /metrics."""
    fleet, metrics, bases = runtime.upstreams, runtime.metrics, runtime.bases
    started = int(time.time())

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> JSONResponse:
        cards = [
            {"id": name, "object": "model", "created": started, "owned_by": "kvroute"}
            | ({"parent": bases[name]} if bases.get(name) else {})  # an adapter's base, as vLLM lists it
            | ({"max_model_len": length} if (length := fleet.max_model_len(name)) is not None else {})
            for name in fleet.served_models()
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD too
    async def health() -> JSONResponse:
        """503 only when no instance is healthy: a load balancer reads the status code, and a router that
        can still serve must stay in rotation. "degraded" (still 200) tells a person or an alert that some
        instance is down, some model has no healthy instance, or the configuration needs a look."""
        healthy = [i.name for i in fleet.instances if i.healthy]
        unhealthy = [i.name for i in fleet.instances if not i.healthy]
        unavailable_models = fleet.unavailable_models()
        warnings = runtime.warnings()
        if not healthy:
            status = "unavailable"
        else:
            status = "degraded" if unhealthy or unavailable_models or warnings else "ok"
        body = {
            "status": status,
            "healthy_instances": healthy,
            "unhealthy_instances": unhealthy,
            "unavailable_models": unavailable_models,
            "instances": len(fleet.instances),
            "warnings": warnings,
        }
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        runtime.programs.expire()  # tool calls past their time-to-live no longer count
        names = frozenset(request.query_params.getlist("name[]"))  # only these samples (a scrape's params)
        return Response(await metrics.render_off_loop(names), media_type=_PROMETHEUS_TEXT)
