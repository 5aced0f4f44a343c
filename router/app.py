"""The router's HTTP surface: OpenAI endpoints, /health and /metrics, on FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import zmq.asyncio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from router.admin import admin_routes, admin_token
from router.admission import Admission
from router.block_index import BlockIndex, Tier
from router.client_auth import ClientAuth, client_key_digests
from router.config import REMOTE_TOKENIZER, RouterConfig
from router.dashboard import dashboard_routes
from router.errors import MALFORMED_HTTP, OpenAIError
from router.fast_path import OpenAIFastPath
from router.health import HealthChecker
from router.http_stack import upstream_session
from router.index_metrics import IndexCollector
from router.instances import Fleet
from router.load_scraper import LoadScraper
from router.metrics import RouterMetrics
from router.openai_body import ChatRequest, CompletionRequest
from router.peer_sync import PeerSync
from router.policy import Policy
from router.pool import MasterLookup, PoolConfirmer, place_instances, pool_names
from router.proxy import (
    ATTEMPTS_HEADER,
    CACHED_BLOCKS_HEADER,
    INSTANCE_HEADER,
    POLICY_HEADER,
    PREDICTED_TTFT_HEADER,
    PROMPT_BLOCKS_HEADER,
    Proxy,
)
from router.reload import Reloader
from router.request_limits import RequestLimits
from router.routing import LocalTokenizer, Router
from router.supervisor import supervise
from router.token_cache import CachedChatTokenizer, RemoteTokenizer
from router.tokenization import PromptTokenizer, resolve_tokenizer_path
from router.traffic import TrafficSplit

log = logging.getLogger(__name__)
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# What a browser page may read of an answer besides the simple headers: when to retry, where it was routed.
_EXPOSED = [
    "retry-after", INSTANCE_HEADER, POLICY_HEADER, CACHED_BLOCKS_HEADER, PROMPT_BLOCKS_HEADER,
    PREDICTED_TTFT_HEADER, ATTEMPTS_HEADER, "x-request-id",
]  # fmt: skip


class RouterApp(NamedTuple):
    api: FastAPI  # every route; its state holds the proxy once the lifespan has started
    asgi: ASGIApp  # what the server runs: the request limits and the OpenAI fast path in front of api
    malformed_http: Callable[[], None]  # counts what the HTTP parser refused before the app saw it


def create_app(config: RouterConfig, path: Path | None = None) -> RouterApp:
    """path: the file config came from, watched and re-read on SIGHUP or POST /admin/reload."""
    fleet = Fleet(config)
    metrics = RouterMetrics()
    tiers = config.index.medium_tiers
    medium_tiers: dict[str | None, Tier] = {medium: Tier[tier.upper()] for medium, tier in tiers.items()}
    index = BlockIndex(
        config.block_size,
        config.index.max_entries,
        config.index.speculative_ttl_s,
        medium_tiers={None: Tier.GPU, **medium_tiers},  # events without a medium are vLLM's own GPU cache
    )
    place_instances(index, config)
    metrics.registry.register(IndexCollector(index, lambda: {i.name for i in fleet.instances}))
    cache = config.tokenization
    # One per tokenizer: a base model and its LoRA adapters share it, and its token cache (the same ids).
    by_source: dict[str, LocalTokenizer] = {}
    for source in dict.fromkeys(m.tokenizer for m in config.models if m.tokenizer != REMOTE_TOKENIZER):
        tokenizer = PromptTokenizer(resolve_tokenizer_path(source))
        by_source[source] = CachedChatTokenizer(tokenizer, cache.cache_max_entries, cache.cache_max_tokens)
    tokenizers = {m.name: by_source[m.tokenizer] for m in config.models if m.tokenizer in by_source}
    policies = {name: Policy(name, policy) for name, policy in config.policies.items()}
    bases = {m.name: m.lora_of for m in config.models}  # models change with a restart only
    adapters = frozenset(name for name, base in bases.items() if base is not None)
    tools_out_when_none = frozenset(m.name for m in config.models if m.exclude_tools_when_tool_choice_none)
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Idle upstream connections close before uvicorn's (vLLM's server) 5 s keep-alive would drop them
        # under a request.
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=config.upstream.max_connections_per_instance, keepalive_timeout=4
        )
        # Health checks, /metrics scrapes, /tokenize and the pool master get connections of their own, never
        # queued behind requests (those are bounded by admission): a busy instance is not a dead one.
        control_connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
        zmq_context = zmq.asyncio.Context()
        async with upstream_session(connector) as session, upstream_session(control_connector) as control:
            health = HealthChecker(fleet, control, config.health, metrics)

            def remote_tokenizer(model: str) -> RemoteTokenizer | None:
                candidates = fleet.candidates(model)
                return RemoteTokenizer(control, candidates[0].url, model) if candidates else None

            pool = None
            if config.pool.master_url is not None:
                lookup = MasterLookup(config.pool.master_url, control, config.pool.timeout_s)
                pool = PoolConfirmer(index, lookup, pool_names(config), metrics, config.pool.confirm_ttl_s)
            router = Router(
                index, tokenizers, config.block_size, metrics, remote_tokenizer, pool, adapters,
                config.tokenization.audit_every, tools_out_when_none,
            )  # fmt: skip
            await health.check_all()
            healthy = sum(i.healthy and i.failed_checks == 0 for i in fleet.instances)
            log.info(
                "routing %s to %d instances (%d answering), default policy %s; the /admin API is %s",
                ", ".join(fleet.models),
                len(fleet.instances),
                healthy,
                config.default_policy,
                "on" if admin_token(config.admin) is not None else "off (no admin.token)",
            )
            admission = config.admission
            slots = Admission(admission.max_in_flight, admission.queue_size, admission.queue_timeout_s)
            metrics.admission_waiting.set_function(lambda: slots.waiting)
            app.state.proxy = Proxy(
                fleet,
                policies,
                TrafficSplit(config.traffic_weights()),
                config.traffic,
                router,
                session,
                health,
                metrics,
                config.upstream,
                config.tokenization.max_body_bytes,
                slots,
                # One connection per request in flight: a request never waits for a pooled one.
                min(admission.max_in_flight_per_instance, config.upstream.max_connections_per_instance),
                admission.memory_hold_s,
                config.tokenization.thread_above_bytes,
                config.limits.body_timeout_s,
                config.limits.send_timeout_s,
            )
            reloader = app.state.reloader = Reloader(
                config, path, fleet, index, metrics, zmq_context, lambda: app.state.proxy
            )
            reloader.subscribe(config.instances)
            load = config.load
            scraper = LoadScraper(
                fleet, control, load.scrape_interval_s, load.timeout_s, load.stale_after_s,
                restarted=reloader.engine_restarted,
            )  # fmt: skip
            peers = config.peers
            sync = None
            if peers.publish is not None or peers.subscribe:
                # Memory a peer's request freed may let requests held here go (admission.memory_hold_s).
                sync = PeerSync(peers, fleet, metrics, zmq_context, lambda: app.state.proxy.memory_freed())
                sync.start()  # a publish endpoint that cannot be bound stops the router here
            failures = metrics.task_failures
            tasks = [
                asyncio.create_task(reloader.watch()),
                asyncio.create_task(
                    supervise("health", health.check_due, health.tick_s, failures, first_delay=True)
                ),
                asyncio.create_task(supervise("load", scraper.scrape_all, scraper.interval_s, failures)),
            ]
            if sync is not None:
                tasks += [
                    asyncio.create_task(supervise(name, loop, peers.interval_s, failures))
                    for name, loop in sync.loops().items()
                ]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if sync is not None:
                    sync.close()
                await reloader.stop()
                router.close()
                zmq_context.destroy(linger=0)

    # kvroute exports its own Prometheus metrics; FastAPI's OpenTelemetry hooks cost time on every request.
    app = FastAPI(
        title="kvroute", lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False}
    )

    def current_config() -> RouterConfig:
        reloader = getattr(app.state, "reloader", None)
        return config if reloader is None else reloader.config

    def client_error(error: OpenAIError) -> None:
        # 429s are counted where they are decided, with the router's own rejections; so are the 401s for a
        # client's API key, which never come here (router/client_auth.py answers them). The admin token's 401
        # and 403 do: missing_token and wrong_token are what probing the admin API looks like.
        if error.status < 500 and error.status != 429:
            metrics.client_errors(str(error.code)).inc()

    def malformed_http() -> None:
        metrics.client_errors(MALFORMED_HTTP).inc()

    async def reload() -> dict[str, Any]:
        return await app.state.reloader.reload()  # type: ignore[no-any-return]

    def current_admin_token() -> str | None:
        return admin_token(current_config().admin)

    app.include_router(admin_routes(current_admin_token, lambda: app.state.proxy, reload))
    app.include_router(dashboard_routes(fleet, index, lambda: app.state.proxy, current_admin_token))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        client_error(exc)
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})  # a 405's Allow, say
        error = OpenAIError(exc.status_code, str(exc.detail), kind, str(exc.status_code), headers=headers)
        client_error(error)
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        error = OpenAIError(400, str(exc), "invalid_request_error", "invalid_request")
        client_error(error)
        return error.response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await request.app.state.proxy.forward(request, "/v1/chat/completions", ChatRequest)  # type: ignore[no-any-return]

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await request.app.state.proxy.forward(request, "/v1/completions", CompletionRequest)  # type: ignore[no-any-return]

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
        reloader: Reloader | None = getattr(app.state, "reloader", None)
        warnings = [] if reloader is None else reloader.warnings()
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
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=_PROMETHEUS_TEXT)

    # Outside FastAPI, whose middleware stack would wrap every request and every send; the limits apply to
    # the fast path and to the app's routes alike.
    fast = OpenAIFastPath(app, proxy=lambda: app.state.proxy, rejected=client_error)
    limits = RequestLimits(
        fast, max_body_bytes=lambda: current_config().limits.max_body_bytes, rejected=client_error
    )
    auth = ClientAuth(limits, client_key_digests(config.auth), metrics.rejected("invalid_api_key").inc)
    if not config.cors.allow_origins:
        return RouterApp(app, auth, malformed_http)
    # Outermost: a browser's preflight carries no API key, and every answer, errors too, needs the headers.
    cors = CORSMiddleware(
        auth, config.cors.allow_origins, allow_methods=["*"], allow_headers=["*"], expose_headers=_EXPOSED
    )
    return RouterApp(app, cors, malformed_http)
