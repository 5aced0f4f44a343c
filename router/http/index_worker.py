"""The index host of `kvroute serve --workers N` (router/http/workers.py): a process of the pool that holds
the machine's one block index and answers the workers' lookups (router/index/index_host.py), serving no HTTP.

It is a router's runtime without the HTTP server: it follows the engines' KV events, checks their health and
load (a restarted engine's entries go), asks the Mooncake master, and reloads the configuration as the workers
do (SIGHUP, a change of the file), so that its subscriptions follow the instances. SIGTERM or SIGINT ends it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import uvloop

from router.config import RouterConfig
from router.reload import Reloader
from router.runtime import Runtime, SharedIndex
from router.upstreams.peer_sync import PeerEndpoints

log = logging.getLogger(__name__)


def run_index_host(config: RouterConfig, path: Path, endpoint: str, ready: Path) -> None:
    """Hold the index and answer on endpoint until SIGTERM or SIGINT; ready: there while it answers."""
    uvloop.run(_host(config, path, endpoint, ready))


async def _host(config: RouterConfig, path: Path, endpoint: str, ready: Path) -> None:
    ended = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, ended.set)
    # It hears no peers' load and publishes none: it routes no request.
    async with Runtime(config, PeerEndpoints(), SharedIndex(endpoint, hosts=True)) as runtime:
        watch = asyncio.create_task(Reloader(runtime, path).watch())
        await asyncio.to_thread(ready.touch)
        log.info("holding the block index for the workers, on %s", endpoint)
        try:
            await ended.wait()
        finally:
            await asyncio.to_thread(ready.unlink, missing_ok=True)
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
    log.info("index host stopped")
