"""The one block index of a machine running `kvroute serve --workers N`, answering its workers.

The host is a router process of the pool (router/http/index_worker.py) that serves no HTTP: it subscribes to
every engine's KV events, holds the index and asks the Mooncake master, and the workers, holding none, ask it
(router/index/remote_index.py) over a Unix socket, a connection each (router/index/host_wire.py). So the
index's memory and its ingest are paid once, not once per worker, and every worker's routed requests are
speculative entries for all of them.

A worker's messages are handled in the order it sent them: a lookup is answered from the index as it stands
once the worker's earlier messages are applied (one that confirms pool credit with the master answers once
the master has). A message that does not decode is counted and passed over; a frame too long to take, or a
worker that leaves its answers unread past MAX_UNREAD_BYTES, ends that worker's connection (it connects
again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping

import msgspec

from router.index.block_index import BlockIndex, Speculation
from router.index.figures import IndexFigures
from router.index.host_wire import (
    AskFigures,
    Batching,
    CacheReset,
    Figures,
    Lookup,
    Matched,
    Routed,
    ToHost,
    ToWorker,
    Unframed,
    Withdraw,
    decode_to_host,
    framed,
    read_frame,
    unpacked,
)
from router.index.pool import PrefixMatches
from router.metrics import RouterMetrics
from scorers.request import TierMatch

log = logging.getLogger(__name__)

# Workers' speculations held for their withdrawal: past this many, the oldest (expired long since, at any
# realistic request rate) go first.
MAX_HELD_SPECULATIONS = 1 << 20
MAX_UNREAD_BYTES = 64 << 20  # answers a worker has not read yet


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
        # (connection, its handle) -> what its routed request entered, and where: oldest first
        self._speculations: OrderedDict[tuple[int, int], tuple[str, Speculation]] = OrderedDict()
        self._connections = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def serve(self, path: str) -> None:
        """Answer on the Unix socket path until cancelled."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a predecessor's
        server = await asyncio.start_unix_server(self._worker, path)
        try:
            async with server:
                await server.serve_forever()
        finally:
            for writer in self._writers:  # the server's close leaves its connections open
                writer.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def _worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        worker = self._connections
        confirming: set[asyncio.Task[None]] = set()
        self._writers.add(writer)
        answers = Batching(writer)
        try:
            while True:
                payload = await read_frame(reader)
                try:
                    message = decode_to_host(payload)
                    await self._handle(answers, worker, message, confirming)
                except (msgspec.DecodeError, ValueError):  # a payload of another shape, a chain of parts
                    self._metrics.index_host_malformed.inc()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went
        except Unframed as exc:
            self._metrics.index_host_malformed.inc()
            log.warning("a worker's connection to the index host ended: %s", exc)
        finally:
            for task in confirming:
                task.cancel()
            self._writers.discard(writer)
            writer.close()

    async def _handle(
        self, answers: Batching, worker: int, message: ToHost, confirming: set[asyncio.Task[None]]
    ) -> None:
        if isinstance(message, Lookup):
            chain = unpacked(message.chain)
            if message.confirm and self._confirmed is not self._as_indexed:
                task = asyncio.create_task(self._answer(answers, message, chain, self._confirmed))
                confirming.add(task)
                task.add_done_callback(confirming.discard)
            else:  # the index alone: answered before the next message is read
                await self._answer(answers, message, chain, self._as_indexed)
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
            _send(answers, Figures(message.id, self._figures()))

    async def _answer(
        self, answers: Batching, lookup: Lookup, chain: list[int], source: PrefixMatches
    ) -> None:
        matches = await source.matches(lookup.model, chain, lookup.reusable)
        _send(answers, Matched(lookup.id, _as_tuples(matches)))

    def _hold(self, worker: int, handle: int, instance: str, entered: Speculation) -> None:
        """Kept until withdrawn, or until it expired in the index anyway."""
        held, now = self._speculations, self._clock()
        while held and (len(held) >= MAX_HELD_SPECULATIONS or next(iter(held.values()))[1].until < now):
            held.popitem(last=False)
        held[worker, handle] = (instance, entered)


def _as_tuples(matches: Mapping[str, TierMatch]) -> dict[str, tuple[int, int, int]]:
    return {name: (m.gpu, m.cpu, m.pool) for name, m in matches.items()}


def _send(answers: Batching, answer: ToWorker) -> None:
    """Never waits: a worker that leaves MAX_UNREAD_BYTES of answers unread is cut off (its lookups time out
    there until it connects again)."""
    if answers.unsent_bytes() > MAX_UNREAD_BYTES:
        answers.close()
        return
    answers.write(framed(answer))
