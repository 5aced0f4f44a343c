"""The router's side of the simulation: what a router can know, and how late.

- the real BlockIndex, fed the engines' KV events event_delay_s after the engine step that caused them;
- router.upstreams.instances.Instance objects carrying the router's own bookkeeping (requests in flight, their
  tokens, prefill not yet answered) and the engines' load as of the last scrape;
- the pool, which kvroute's policy asks through router/index/pool.py's PoolConfirmer as it asks the Mooncake
master.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvroute.simulate.clock import EventLoop
from kvroute.simulate.engine import Engine
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.pool import PoolStore
from router.index.block_index import BlockIndex
from router.index.events import KVEvent
from router.upstreams.instances import Instance, InstanceSetup
from scorers.request import TierMatch
from scorers.ttft_model import FleetModels, TTFTModel, TTFTPriors


def instance_name(number: int) -> str:
    return f"sim-{number}"


class RouterView:
    def __init__(
        self,
        fleet: FleetSpec,
        loop: EventLoop,
        engines: Sequence[Engine],
        pool: PoolStore | None,
        priors: TTFTPriors,
        speculative_ttl_s: float = 2.0,
        listen: bool = True,
        tie_seed: int = 0,
    ) -> None:
        """listen=False: the engines' events reach this view only through the view it is a replica of;
        tie_seed: what the router's picker breaks ties with, so that a run repeats exactly."""
        self.loop = loop
        self.tie_rng = random.Random(tie_seed)
        self.block_size = fleet.engine.block_size
        self.model = fleet.model
        self.index = BlockIndex(
            fleet.engine.block_size, speculative_ttl_s=speculative_ttl_s, clock=loop.clock
        )
        fleet_models = FleetModels(priors)  # as router/upstreams/instances.py pools them
        self.instances = [
            Instance(
                name=instance_name(e.number),
                url=f"http://{instance_name(e.number)}",
                models=frozenset({fleet.model}),
                setup=InstanceSetup(
                    ttft_model=TTFTModel(priors, fleet_models.of(fleet.role(e.number))),
                    kv_capacity_tokens=fleet.engine.kv_tokens,
                    clock=loop.clock,
                    block_size=fleet.engine.block_size,
                    role=fleet.role(e.number),
                ),
            )
            for e in engines
        ]
        self.by_name = {instance.name: number for number, instance in enumerate(self.instances)}
        self.pool = pool
        self._engines, self._delay = engines, fleet.event_delay_s
        self._fleet, self._priors, self._speculative_ttl_s = fleet, priors, speculative_ttl_s
        self._replicas: list[RouterView] = []
        for engine, instance in zip(engines, self.instances, strict=True):
            if pool is not None:
                self.index.join_pool(instance.name)
            if listen:
                engine.on_events = lambda events, name=instance.name: self._deliver(name, events)  # type: ignore[misc]

    def replica(self) -> RouterView:
        """Another router's view of the same fleet: its own index, fed the same events as late, its own
        bookkeeping, and the same scrapes of the engines' metrics."""
        other = RouterView(
            self._fleet,
            self.loop,
            self._engines,
            self.pool,
            self._priors,
            self._speculative_ttl_s,
            listen=False,
            tie_seed=self.tie_rng.getrandbits(64),
        )
        self._replicas.append(other)
        return other

    def _deliver(self, name: str, events: list[KVEvent]) -> None:
        owner = (name, 0)
        for index in (self.index, *(replica.index for replica in self._replicas)):
            self.loop.at(self.loop.now + self._delay, lambda index=index: index.apply(owner, events))  # type: ignore[misc]

    def scrape(self) -> None:
        """What the router reads of each engine's /metrics (router/upstreams/load_scraper.py)."""
        for engine, instance in zip(self._engines, self.instances, strict=True):
            instance.load = engine.load()
        for replica in self._replicas:
            replica.scrape()

    def matches(self, chain: Sequence[int], include_pool: bool = True) -> dict[str, TierMatch]:
        """The index's matches, pool credit unconfirmed (what a router without a master sees)."""
        return self.index.match(chain, include_pool=include_pool and self.pool is not None)
