"""The index's side of the engines: one KV-event subscription per instance that publishes events."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from router.config import InstanceConfig
from router.index.block_index import BlockIndex
from router.index.subscriber import KVEventSubscriber
from router.metrics import RouterMetrics


class Subscriptions:
    def __init__(self, index: BlockIndex, metrics: RouterMetrics, context: zmq.asyncio.Context) -> None:
        self._index, self._metrics, self._context = index, metrics, context
        self._running: dict[str, tuple[KVEventSubscriber, asyncio.Task[None]]] = {}

    def subscribe(self, instances: list[InstanceConfig]) -> None:
        for instance in instances:
            if instance.events is None:
                continue
            subscriber = KVEventSubscriber(
                instance.name,
                instance.events,
                instance.replay,
                self._index,
                self._metrics,
                self._context,
                block_size=self._index.block_size,
            )
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
