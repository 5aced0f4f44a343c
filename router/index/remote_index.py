"""A worker's view of its machine's one block index, held by the index host (router/index/index_host.py).

The worker asks the host for each request's matches and tells it where requests went, over a Unix socket
(router/index/host_wire.py); it waits for an answer at most LOOKUP_TIMEOUT_S. A lookup the host does not
answer in time, or that cannot be sent (the host is restarting, or has not read what was sent before), routes
without prefix knowledge, as a router with an empty index does, and kvroute_index_host_lookups_total{outcome}
counts it. What the worker tells (routed requests, withdrawals, cache resets) is sent without waiting: lost
with a host that is down, as the host's index is. The worker connects again while it runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping, Sequence

import msgspec

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
    Unframed,
    Withdraw,
    decode_to_worker,
    framed,
    packed,
    read_frame,
)
from router.metrics import RouterMetrics
from scorers.request import TierMatch

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 0.5
FIGURES_EVERY_S = 1.0  # how often the host's figures are fetched for /metrics and the dashboard
RECONNECT_S = 0.1  # between attempts to reach a host that is not there
MAX_UNSENT_BYTES = 16 << 20  # what the host has not taken yet, past which nothing more is sent
_NOTHING: Mapping[str, TierMatch] = {}


class RemoteIndex:
    """The RoutingIndex of a worker of several (router/index/routing_index.py), and its lookups."""

    def __init__(self, path: str, metrics: RouterMetrics, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        """path: the host's Unix socket."""
        self._path, self._metrics, self._timeout_s = path, metrics, timeout_s
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Mapping[str, TierMatch]]] = {}
        self._batching: Batching | None = None  # the connection to the host, while there is one
        self.figures = IndexFigures()  # the host's, as last fetched (none while it does not answer)
        self._figures_answered = True

    async def run(self) -> None:
        """Stay connected to the host and take its answers until cancelled."""
        fetching = asyncio.create_task(self._fetch_figures())
        try:
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(self._path)
                except OSError:  # not there yet, or restarting
                    await asyncio.sleep(RECONNECT_S)
                    continue
                self._batching = Batching(writer)
                try:
                    await self._answers(reader)
                except (asyncio.IncompleteReadError, ConnectionError, Unframed) as exc:
                    log.info("the index host's connection ended (%r); connecting again", exc)
                finally:
                    self._batching = None
                    writer.close()
                    for waiting in self._waiting.values():  # their answers went with the connection
                        if not waiting.done():
                            waiting.set_exception(ConnectionResetError("the index host's connection ended"))
        finally:
            fetching.cancel()

    async def _answers(self, reader: asyncio.StreamReader) -> None:
        while True:
            payload = await read_frame(reader)
            try:
                answer = decode_to_worker(payload)
            except (msgspec.DecodeError, UnicodeDecodeError):
                log.warning("the index host sent an answer of another shape: passed over")
                continue
            if isinstance(answer, Figures):
                self.figures, self._figures_answered = answer.figures, True
                continue
            waiting = self._waiting.get(answer.id)
            if waiting is not None and not waiting.done():
                waiting.set_result(_matches(answer))

    async def matches(
        self, model: str, chain: Sequence[int], reusable: int | None, confirm: bool
    ) -> Mapping[str, TierMatch]:
        lookups = self._metrics.index_host_lookups
        asked = next(self._ids)
        if not self._send(Lookup(asked, model, packed(chain), reusable, confirm)):
            lookups("unreachable").inc()
            return _NOTHING
        answer: asyncio.Future[Mapping[str, TierMatch]] = asyncio.get_running_loop().create_future()
        self._waiting[asked] = answer
        try:
            async with asyncio.timeout(self._timeout_s):
                matches = await answer
        except TimeoutError:
            lookups("late").inc()
            return _NOTHING
        except ConnectionResetError:
            lookups("unreachable").inc()
            return _NOTHING
        finally:
            del self._waiting[asked]
        lookups("answered").inc()
        return matches

    def routed(self, instance: str, chain: Sequence[int], held: int) -> int | None:
        handle = next(self._ids) if len(chain) > held else 0
        self._send(Routed(instance, packed(chain), held, handle))
        return handle or None

    def withdraw(self, instance: str, speculation: int) -> None:
        self._send(Withdraw(instance, speculation))

    def cache_reset(self, instance: str) -> None:
        self._send(CacheReset(instance))

    def _send(self, message: ToHost) -> bool:
        """Sent now, or not at all: False while the host is unreachable or has not taken MAX_UNSENT_BYTES."""
        batching = self._batching
        if batching is None or batching.closing() or batching.unsent_bytes() > MAX_UNSENT_BYTES:
            return False
        batching.write(framed(message))
        return True

    async def _fetch_figures(self) -> None:
        """Asked again each FIGURES_EVERY_S; a host that did not answer the last ask reports nothing rather
        than what a host gone since held."""
        while True:
            if not self._figures_answered:
                self.figures = IndexFigures()
            self._figures_answered = False
            self._send(AskFigures(next(self._ids)))
            await asyncio.sleep(FIGURES_EVERY_S)


class RemoteMatches:
    """PrefixMatches from the host: its pool credit confirmed with the master (confirm), or as indexed."""

    def __init__(self, index: RemoteIndex, confirm: bool) -> None:
        self._index, self._confirm = index, confirm

    async def matches(
        self, model: str, chain: Sequence[int], reusable: int | None = None
    ) -> Mapping[str, TierMatch]:
        return await self._index.matches(model, chain, reusable, self._confirm)


def _matches(answer: Matched) -> dict[str, TierMatch]:
    """Most instances of a large fleet match alike (a shared system prompt): one TierMatch each way."""
    made: dict[tuple[int, int, int], TierMatch] = {}
    return {
        name: made.get(blocks) or made.setdefault(blocks, TierMatch(*blocks))
        for name, blocks in answer.matches.items()
    }
