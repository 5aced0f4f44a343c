"""Runs the router app on uvicorn with uvloop and httptools, and shuts it down gracefully; alone, or as one
worker of several on a port they share (router/http/workers.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from router.config import RouterConfig
from router.http.app import create_app
from router.runtime import SharedIndex
from router.upstreams.http_session import freeze_startup_objects, server_config
from router.upstreams.peer_sync import PeerEndpoints

log = logging.getLogger(__name__)

# Streams still running when the grace period ends are ended by the router itself, with an error event and
# [DONE]; uvicorn cancels what is left (whole answers still computing) this much later.
_CANCEL_AFTER_S = 1
WORKER_HEADER = "x-kvroute-worker"  # on every answer of a worker of several: its process id


@dataclass(frozen=True)
class Worker:
    """One of several routers serving one port (router/http/workers.py)."""

    socket: socket.socket  # its pool's, listening on the port with the other workers' (SO_REUSEPORT)
    peers: PeerEndpoints  # its own publish endpoint, following its siblings'
    ready: Path  # there while it accepts connections: created once it serves, removed when it stops
    index: str  # the Unix socket the pool's index host answers on (router/index/index_host.py)

    def accepting(self, accepts: bool) -> None:
        if accepts:
            self.ready.touch()
        else:
            self.ready.unlink(missing_ok=True)


class _GracefulServer(uvicorn.Server):
    """On SIGTERM uvicorn stops accepting connections and waits for those in flight up to its timeout, then
    cancels them; this ends the streams cleanly before that."""

    def __init__(
        self,
        config: uvicorn.Config,
        app: FastAPI,
        grace_s: float,
        accepting: Callable[[bool], None] = lambda _: None,
    ) -> None:
        super().__init__(config)
        self._app, self._grace_s, self._accepting = app, grace_s, accepting

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # After the app's start (uvicorn runs it first): what the runtime built for each instance (its
        # KV-event subscription, its metrics' series) lives as long as start-up's. Frozen only before it, a
        # fleet of 2,000 left 283,000 objects for each full collection to walk: 130 ms of the loop each.
        freeze_startup_objects()
        if self.started and not self.should_exit:  # not when a SIGTERM came during the startup
            self._accepting(True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info("shutting down: no new connections; streams in flight get %g s to finish", self._grace_s)
        for server in self.servers:  # uvicorn's first step too, taken here so that `accepting` follows it
            server.close()
        self._accepting(False)
        ending = asyncio.get_running_loop().call_later(self._grace_s, self._end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    def _end_streams(self) -> None:
        proxy = getattr(self._app.state, "proxy", None)
        if proxy is not None:
            proxy.end_streams()


def run_server(
    config: RouterConfig, host: str, port: int, path: Path | None = None, worker: Worker | None = None
) -> None:
    shared = None if worker is None else SharedIndex(worker.index, hosts=False)
    app = create_app(config, path, None if worker is None else worker.peers, shared)
    freeze_startup_objects()  # before the app's start too, whose collections would walk it all
    grace = math.ceil(config.shutdown_grace_s) + _CANCEL_AFTER_S
    headers = [] if worker is None else [(WORKER_HEADER, str(os.getpid()))]
    limits = config.limits
    serving = server_config(
        app.asgi,
        host,
        port,
        app.refused_http,
        limits.header_timeout_s,
        limits.max_header_bytes,
        timeout_graceful_shutdown=grace,
        headers=headers,
    )
    if worker is None:
        _GracefulServer(serving, app.api, config.shutdown_grace_s).run()
        return
    _GracefulServer(serving, app.api, config.shutdown_grace_s, worker.accepting).run([worker.socket])
