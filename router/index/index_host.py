"""The one block index of a machine running `kvroute serve --workers N`, answering its workers.

The host is a router process of the pool (router/http/index_worker.py) that serves no HTTP: it subscribes to
every engine's KV events, holds the index and asks the Mooncake master, and the workers, holding none, ask it
(router/index/remote_index.py). So the index's memory and its ingest are paid once, not once per worker, and
every worker's routed requests count as speculative entries for all of them.

Messages (router/index/host_wire.py) are handled in the order each worker sent them: a lookup is answered
from the index as it stands once the worker's earlier messages are applied (one that confirms pool credit
with the master answers once the master has). A message that does not decode is counted and passed over.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping

import msgspec
import zmq
import zmq.asyncio

from router.index.block_index import BlockIndex, Speculation
from router.index.figures import IndexFigures
from router.index.host_wire import (
    MAX_MESSAGE_BYTES,
    AskFigures,
    CacheReset,
    Figures,
    Lookup,
    Matched,
    Routed,
    ToHost,
    Withdraw,
    decode_to_host,
    encode,
    unpacked,
)
from router.index.pool import PrefixMatches
from router.metrics import RouterMetrics
from scorers.request import TierMatch

log = logging.getLogger(__name__)

# Workers' speculations held for their withdrawal: past this many, the oldest (expired long since, at any
# realistic request rate) go first.
MAX_HELD_SPECULATIONS = 1 << 20


class IndexHost:
    def __init__(
        self,
        index: BlockIndex,
        confirmed: PrefixMatches,
        as_indexed: PrefixMatches,
        figures: Callable[[], IndexFigures],
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        """confirmed: the matches with pool credit confirmed (as_indexed where there is no master);
        clock: the index's, which its speculations' deadlines are on."""
        self._index, self._confirmed, self._as_indexed = index, confirmed, as_indexed
        self._figures, self._metrics, self._clock = figures, metrics, clock
        # (worker, its handle) -> what its routed request entered, and where: oldest first
        self._speculations: OrderedDict[tuple[bytes, int], tuple[str, Speculation]] = OrderedDict()
        self._confirming: set[asyncio.Task[None]] = set()

    async def serve(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        """Answer on endpoint until cancelled."""
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.bind(endpoint)
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                if len(frames) != 2:
                    self._metrics.index_host_malformed.inc()
                    continue
                try:
                    await self._handle(sock, frames[0], decode_to_host(frames[1]))
                except (msgspec.DecodeError, ValueError):  # a payload of another shape, a chain of parts
                    self._metrics.index_host_malformed.inc()
        finally:
            for task in self._confirming:
                task.cancel()
            sock.close()

    async def _handle(self, sock: zmq.asyncio.Socket, worker: bytes, message: ToHost) -> None:
        if isinstance(message, Lookup):
            chain = unpacked(message.chain)
            if message.confirm and self._confirmed is not self._as_indexed:
                task = asyncio.create_task(self._answer(sock, worker, message, chain, self._confirmed))
                self._confirming.add(task)
                task.add_done_callback(self._confirming.discard)
            else:  # the index alone: answered before the next message is read
                await self._answer(sock, worker, message, chain, self._as_indexed)
        elif isinstance(message, Routed):
            entered = self._index.routed(message.instance, unpacked(message.chain), message.held)
            if entered is not None:
                self._hold(worker, message.speculation, message.instance, entered)
        elif isinstance(message, Withdraw):
            held = self._speculations.pop((worker, message.speculation), None)
            if held is not None:
                self._index.withdraw(*held)
        elif isinstance(message, CacheReset):
            self._index.cache_reset(message.instance)
        elif isinstance(message, AskFigures):
            _send(sock, worker, encode(Figures(message.id, self._figures())))

    async def _answer(
        self, sock: zmq.asyncio.Socket, worker: bytes, lookup: Lookup, chain: list[int], source: PrefixMatches
    ) -> None:
        matches = await source.matches(lookup.model, chain, lookup.reusable)
        _send(sock, worker, encode(Matched(lookup.id, _as_tuples(matches))))

    def _hold(self, worker: bytes, handle: int, instance: str, entered: Speculation) -> None:
        """Kept until withdrawn, or until it expired in the index anyway."""
        held, now = self._speculations, self._clock()
        while held and (len(held) >= MAX_HELD_SPECULATIONS or next(iter(held.values()))[1].until < now):
            held.popitem(last=False)
        held[worker, handle] = (instance, entered)


def _as_tuples(matches: Mapping[str, TierMatch]) -> dict[str, tuple[int, int, int]]:
    return {name: (m.gpu, m.cpu, m.pool) for name, m in matches.items()}


def _send(sock: zmq.asyncio.Socket, worker: bytes, payload: bytes) -> None:
    """Never waits: a ROUTER drops what a gone or saturated worker cannot take, and that worker's lookup
    times out there."""
    sock.send_multipart([worker, payload], zmq.NOBLOCK)
