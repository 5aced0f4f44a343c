"""`kvroute epp`: the endpoint picker as a gRPC server (Envoy's ext_proc and gRPC health), on a Runtime that
runs everything `kvroute serve` runs (index subscriptions, health checks, load scrapes, metrics), with the
metrics on an HTTP port of their own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.config import RouterConfig
from router.epp import messages
from router.epp.picking import Picker
from router.epp.session import Exchanges
from router.runtime import Runtime
from router.supervisor import supervise

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_ALWAYS_SERVING = ("", "liveness")  # the process answers
_SERVING_WHEN_READY = ("readiness", EXT_PROC_SERVICE)  # and some instance can take a request
_READINESS_EVERY_S = 1.0
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Listen:
    host: str
    port: int  # gRPC (ext_proc and health)
    metrics_port: int  # HTTP: /metrics and /health


class ExtProc:
    """envoy.service.ext_proc.v3.ExternalProcessor: one Exchange per routing stream, closed however it ends;
    an observing stream (Envoy's observability mode: nothing it is answered is read) tells the exchange it
    names what it sees of the answer, and ends once there is nothing more to learn."""

    def __init__(self, picker: Picker, max_body_bytes: int) -> None:
        self._exchanges = Exchanges(picker, max_body_bytes)

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        exchange = None
        try:
            async for message in requests:
                if message.observability_mode:
                    await self._observe(message, requests)
                    return
                if exchange is None:
                    exchange = self._exchanges.new()
                for answer in await exchange.on(message):
                    yield answer
        except Exception:
            log.exception("ext_proc stream failed")  # the gateway applies its failure mode
            raise
        finally:
            if exchange is not None:
                exchange.close()

    async def _observe(self, first: Any, requests: AsyncIterator[Any]) -> None:
        exchange = self._exchanges.get(messages.exchange_key(first))
        if exchange is None:
            return
        try:
            message = first
            while not message.HasField("response_body") or exchange.observed(message.response_body):
                message = await anext(requests)
        except StopAsyncIteration:
            pass
        finally:
            exchange.observer_closed()


def run_epp(config: RouterConfig, listen: Listen, fallbacks: int) -> None:
    asyncio.run(_serve(config, listen, fallbacks))


async def _serve(config: RouterConfig, listen: Listen, fallbacks: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with Runtime(config) as runtime:
        picker = Picker(runtime.routing, runtime.health, runtime.metrics, fallbacks)
        server = grpc.aio.server()
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExtProc(picker, config.limits.max_body_bytes), server
        )
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        host = f"[{listen.host}]" if ":" in listen.host else listen.host
        server.add_insecure_port(f"{host}:{listen.port}")  # raises when the port cannot be bound
        for service in _ALWAYS_SERVING:
            await checks.set(service, health_pb2.HealthCheckResponse.SERVING)

        async def readiness() -> None:
            ready = any(i.healthy for i in runtime.upstreams.instances)
            serving = health_pb2.HealthCheckResponse
            status = serving.SERVING if ready else serving.NOT_SERVING
            for service in _SERVING_WHEN_READY:
                await checks.set(service, status)

        await readiness()
        await server.start()
        # Up last: a process manager (or a test) that sees /metrics answer finds the gRPC port open too.
        metrics_site = await _metrics_site(runtime, listen)
        ready_task = asyncio.create_task(
            supervise("epp_readiness", readiness, _READINESS_EVERY_S, runtime.metrics.task_failures)
        )
        log.info(
            "endpoint picker on %s:%d (gRPC: ext_proc, health), metrics on %s:%d; %d instances, fallbacks %d",
            listen.host,
            listen.port,
            listen.host,
            listen.metrics_port,
            len(runtime.upstreams.instances),
            fallbacks,
        )
        try:
            await stop.wait()
        finally:
            log.info("shutting down: streams in flight get %g s to finish", config.shutdown_grace_s)
            await checks.enter_graceful_shutdown()
            await server.stop(config.shutdown_grace_s)
            ready_task.cancel()
            await asyncio.gather(ready_task, return_exceptions=True)
            await metrics_site.cleanup()


async def _metrics_site(runtime: Runtime, listen: Listen) -> web.AppRunner:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=runtime.metrics.render(), headers={"Content-Type": _PROMETHEUS_TEXT})

    async def health(request: web.Request) -> web.Response:
        healthy = [i.name for i in runtime.upstreams.instances if i.healthy]
        return web.json_response({"healthy_instances": healthy}, status=200 if healthy else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, listen.host, listen.metrics_port).start()
    return runner
