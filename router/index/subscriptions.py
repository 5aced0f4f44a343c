"""The index's side of the engines: one KV-event subscription per instance that publishes events.

Following an instance takes a few ZMQ sockets (its SUB, the pair of sockets its disconnect monitor takes, a
replay's DEALER while it warms up) and a file for each, plus its TCP connections. libzmq's default of 1,023
sockets a context once left half of a 1,000-instance fleet unsubscribed; the context here may open as many
as libzmq allows (a slot costs a few bytes until used), and the process as many files as its hard limit.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable

import zmq.asyncio

from router.config import InstanceConfig
from router.index.block_index import BlockIndex
from router.index.ingest_turns import IngestTurns
from router.index.subscriber import KVEventSubscriber, Source, SubscriberOptions
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

FILES_PER_INSTANCE = 6  # its sockets' mailboxes and connections, a replay's included


def events_context() -> zmq.asyncio.Context:
    """A context for the KV-event subscriptions, sized for fleets of thousands."""
    context = zmq.asyncio.Context()
    context.set(zmq.MAX_SOCKETS, context.get(zmq.SOCKET_LIMIT))
    return context


def open_files_limit() -> int:
    """The open files this process may have, its soft limit raised to its hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a hard limit of "unlimited" that the kernel caps lower
            pass
    return soft


class Subscriptions:
    def __init__(
        self,
        index: BlockIndex,
        metrics: RouterMetrics,
        context: zmq.asyncio.Context,
        busy: Callable[[], bool],
    ) -> None:
        """busy: whether the router has requests in progress (ingest then takes shorter turns)."""
        self._index, self._metrics, self._context = index, metrics, context
        self._running: dict[str, tuple[KVEventSubscriber, asyncio.Task[None]]] = {}
        # The event loop's time for ingest, shared by every instance's events
        self._turns = IngestTurns(busy=busy)

    def subscribe(self, instances: list[InstanceConfig]) -> None:
        following = len(self._running) + sum(instance.events is not None for instance in instances)
        limit = open_files_limit()
        if following * FILES_PER_INSTANCE > limit:
            log.warning(
                "following %d instances' KV events takes up to %d open files; this process may open %d "
                "(its hard limit: raise it, as ulimit -Hn or the container's nofile, or some instances go "
                "unfollowed and are routed without prefix knowledge)",
                following,
                following * FILES_PER_INSTANCE,
                limit,
            )
        for instance in instances:
            if instance.events is None:
                continue
            source = Source(instance.name, instance.events, instance.replay)
            options = SubscriberOptions(block_size=self._index.block_size, turns=self._turns)
            subscriber = KVEventSubscriber(source, self._index, self._metrics, self._context, options)
            self._running[instance.name] = subscriber, asyncio.create_task(subscriber.run())

    def unsubscribe(self, name: str) -> None:
        subscription = self._running.pop(name, None)
        if subscription is not None:
            subscription[1].cancel()

    def warnings(self) -> list[str]:
        """What an operator must fix for routing to work as configured: instances whose KV blocks are of
        another size than the index's."""
        return [
            f"{name} publishes KV blocks of {subscriber.foreign_block_size} tokens; block_size is "
            f"{self._index.block_size}"
            for name, (subscriber, _) in self._running.items()
            if subscriber.foreign_block_size is not None
        ]

    def engine_restarted(self, name: str) -> None:
        """A new engine process serves instance name (the load scraper saw its start time change): its
        subscriber knows which index entries the new process holds; without one, nothing does, and all go."""
        subscription = self._running.get(name)
        if subscription is None:
            self._index.drop_instance(name)
        else:
            subscription[0].engine_restarted()

    async def stop(self) -> None:
        tasks = [task for _, task in self._running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()
