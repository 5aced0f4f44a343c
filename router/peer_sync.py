"""Routers in front of the same fleet tell each other their load, over ZMQ.

Each router binds a PUB socket (`peers.publish`) and every `peers.interval_s` publishes a snapshot of what it
has in flight on each instance; it subscribes to every other router's (`peers.subscribe`) and counts theirs
with its own (router/peer_load.py). A snapshot stands alone: a lost one is replaced by the next, a router that
restarts starts from nothing, and one that stops publishing drops out after `peers.stale_after_s`.

Wire format: one frame, msgpack of `{"router": ID, "instances": {NAME: [in_flight, active_tokens,
pending_prefill_tokens]}}`, ID a random id a router draws at start. Malformed snapshots are counted and
skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Annotated

import msgspec
import zmq
import zmq.asyncio

from router.config import PeersConfig
from router.instances import Fleet
from router.metrics import RouterMetrics
from router.peer_load import PeerLoad, PeerLoads, own_loads

log = logging.getLogger(__name__)

_Count = Annotated[int, msgspec.Meta(ge=0)]
_MAX_MESSAGE_BYTES = 4 * 2**20


class PeerSnapshot(msgspec.Struct):
    router: str
    instances: dict[str, tuple[_Count, _Count, _Count]]


class PeerSync:
    """Publishes this router's load and follows its peers'.

    ```
    sync = PeerSync(config.peers, fleet, metrics, context)
    tasks = [asyncio.create_task(sync.publish()), asyncio.create_task(sync.follow())]
    ```
    """

    def __init__(
        self,
        config: PeersConfig,
        fleet: Fleet,
        metrics: RouterMetrics,
        context: zmq.asyncio.Context,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_id = uuid.uuid4().hex[:16]
        self.loads = PeerLoads(config.stale_after_s, clock)
        self._config, self._fleet, self._metrics, self._context = config, fleet, metrics, context
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PeerSnapshot)

    def snapshot(self) -> bytes:
        loads = own_loads(self._fleet.instances)
        return self._encoder.encode(PeerSnapshot(self.router_id, dict(loads.items())))

    def receive(self, message: bytes) -> None:
        """Take one peer's snapshot; malformed ones and this router's own are counted and skipped."""
        try:
            snapshot = self._decoder.decode(message)
        except msgspec.DecodeError:
            self._metrics.peer_snapshots("malformed").inc()
            return
        if snapshot.router == self.router_id:
            self._metrics.peer_snapshots("own").inc()
            return
        self._metrics.peer_snapshots("applied").inc()
        loads = {name: PeerLoad(*load) for name, load in snapshot.instances.items()}
        self.loads.update(snapshot.router, loads)
        self._apply()

    def expire(self) -> None:
        if self.loads.expire():
            self._apply()

    def _apply(self) -> None:
        self.loads.apply(self._fleet.instances)
        self._metrics.peer_routers.set(self.loads.peers)

    async def publish(self) -> None:
        """Every interval: this router's snapshot out, peers gone silent forgotten."""
        socket = self._context.socket(zmq.PUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 4)  # a slow subscriber gets the latest, not a backlog
        try:
            if self._config.publish is not None:
                socket.bind(self._config.publish)
            while True:
                if self._config.publish is not None:
                    await socket.send(self.snapshot())
                self.expire()
                await asyncio.sleep(self._config.interval_s)
        finally:
            socket.close(linger=0)

    async def follow(self) -> None:
        """Take every peer's snapshots as they come."""
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.RCVHWM, 64)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            for endpoint in self._config.subscribe:
                socket.connect(endpoint)
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 1:
                    self._metrics.peer_snapshots("malformed").inc()
                    continue
                self.receive(frames[0])
        finally:
            socket.close(linger=0)
