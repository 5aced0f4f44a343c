"""`kvroute epp`: the endpoint picker as a gRPC server (Envoy's ext_proc and gRPC health), on a Runtime that
runs everything `kvroute serve` runs (index subscriptions, health checks, load scrapes, metrics, the
configuration file followed and re-read on SIGHUP), with the metrics on an HTTP port of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from router.config import RouterConfig
from router.epp import messages
from router.epp.grpc_service import Readiness, start_server
from router.epp.picking import Picker
from router.epp.session import Exchanges
from router.reload import Reloader
from router.runtime import Runtime
from router.supervisor import supervise
from router.upstreams.http_session import freeze_startup_objects

log = logging.getLogger(__name__)

_READINESS_EVERY_S = 1.0
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Listen:
    host: str
    port: int  # gRPC (ext_proc and health)
    metrics_port: int  # HTTP: /metrics and /health


class ExtProc:
    """envoy.service.ext_proc.v3.ExternalProcessor. A routing stream gets an Exchange of its own; the streams
    that follow a request (router/epp/session.py) find it by the key they name: the answering stream (its
    first message is the answer's headers) is told like a routing stream and ends the request when it closes,
    and an observing stream (Envoy's observability mode: nothing it is answered is read) tells what it sees
    of the answer and ends once there is nothing more to learn. A routing stream that Envoy marks routing
    only (messages.routing_only) ends as soon as the request is decided."""

    def __init__(self, picker: Picker, max_body_bytes: int) -> None:
        self._exchanges = Exchanges(picker, max_body_bytes)

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncGenerator[Any, None]:
        first = await anext(requests, None)
        if first is None:
            return
        if first.observability_mode:
            await self._observe(first, requests)
            return
        routing_only = False
        if first.HasField("response_headers"):
            found = self._exchanges.get(messages.exchange_key(first))
            if found is None:  # not an inference request, or one a picker since restarted routed
                yield messages.response_headers({}, [messages.SERVED_KEY])
                return
            exchange = found
        else:
            exchange = self._exchanges.new()
            routing_only = messages.routing_only(context.invocation_metadata())
        try:
            message = first
            while message is not None:
                for answer in await exchange.on(message):
                    yield answer
                if routing_only and exchange.decided:
                    return  # Envoy goes on without this stream: a picker that dies now fails nothing
                message = await anext(requests, None)
        except Exception:
            log.exception("ext_proc stream failed")  # the gateway applies its failure mode
            raise
        finally:
            if routing_only:
                exchange.routing_closed()
            else:
                exchange.close()

    async def _observe(self, first: Any, requests: AsyncIterator[Any]) -> None:
        exchange = self._exchanges.get(messages.exchange_key(first))
        if exchange is None:
            return
        exchange.follow()
        try:
            message = first
            while not message.HasField("response_body") or exchange.observed(message.response_body):
                message = await anext(requests)
        except StopAsyncIteration:
            pass
        finally:
            exchange.observer_closed()


def run_epp(config: RouterConfig, listen: Listen, fallbacks: int, path: Path | None = None) -> None:
    """path: the file config came from, re-read on SIGHUP and when what it holds changes (router/reload.py);
    None: config is kept as it is. On uvloop, as `serve` is: gRPC (router/epp/grpc_service.py) runs on the
    same loop."""
    uvloop.run(_serve(config, listen, fallbacks, path))


async def _serve(config: RouterConfig, listen: Listen, fallbacks: int, path: Path | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with Runtime(config) as runtime, contextlib.AsyncExitStack() as stack:
        picker = Picker(runtime.routing, runtime.health, runtime.metrics, fallbacks)
        readiness = Readiness()
        await _background(stack, runtime, readiness, Reloader(runtime, path))
        max_body_bytes = config.limits.max_body_bytes
        ext_proc = ExtProc(picker, max_body_bytes)
        server, service = await start_server(ext_proc, readiness, listen.host, listen.port, max_body_bytes)
        # Up last: a process manager (or a test) that sees /metrics answer finds the gRPC port open too.
        stack.push_async_callback((await _metrics_site(runtime, listen)).cleanup)
        log.info(
            "endpoint picker on %s:%d (gRPC: ext_proc, health), metrics on %s:%d; %d instances, fallbacks %d",
            listen.host,
            listen.port,
            listen.host,
            listen.metrics_port,
            len(runtime.upstreams.instances),
            fallbacks,
        )
        # As `serve` does, start-up's objects are out of the collector's walks; the young generation is
        # collected as often as Python's default, which keeps the HTTP/2 libraries' garbage to short walks.
        freeze_startup_objects(fewer_young_collections=False)
        try:
            await stop.wait()
        finally:
            log.info("shutting down: streams in flight get %g s to finish", config.shutdown_grace_s)
            readiness.shut_down()
            await service.drain(config.shutdown_grace_s)
            server.close()
            await server.wait_closed()


async def _background(
    stack: contextlib.AsyncExitStack, runtime: Runtime, health: Readiness, reloader: Reloader
) -> None:
    """Readiness set, then followed (some instance healthy), and the configuration file watched, until stack
    closes."""

    async def readiness() -> None:
        health.set(any(i.healthy for i in runtime.upstreams.instances))

    await readiness()
    failures = runtime.metrics.task_failures
    tasks = [
        asyncio.create_task(supervise("epp_readiness", readiness, _READINESS_EVERY_S, failures)),
        asyncio.create_task(reloader.watch()),
    ]

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    stack.push_async_callback(stop)


async def _metrics_site(runtime: Runtime, listen: Listen) -> web.AppRunner:
    async def metrics(request: web.Request) -> web.Response:
        runtime.programs.expire()  # tool calls past their time-to-live no longer count
        body = await runtime.metrics.render_off_loop(frozenset(request.query.getall("name[]", ())))
        return web.Response(body=body, headers={"Content-Type": _PROMETHEUS_TEXT})

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
