"""What other kvroute routers in front of the same fleet have in flight on each instance.

Each router counts the requests it sent; an instance's load is every router's. Routers that run side by side
(replicas for availability, or one per core) publish their own counts per instance every so often
(router/upstreams/peer_sync.py), and each keeps the latest from every peer here, summed per instance into
what its scorers read (router/upstreams/instances.py). A peer silent for stale_after_s drops out: it stopped,
and its requests with it, or it can no longer be heard. Contexts two routers both have in flight on an
instance count once per router: a prefix they share is counted twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, Protocol


class PeerLoad(NamedTuple):
    in_flight: int = 0
    active_tokens: int = 0
    pending_prefill_tokens: int = 0


NO_PEER_LOAD = PeerLoad()


class CountedInstance(Protocol):
    """What this module reads and sets of an instance (router/upstreams/instances.py's Instance)."""

    name: str
    own_in_flight: int
    own_pending_prefill_tokens: int
    peers: PeerLoad

    @property
    def own_active_tokens(self) -> int: ...


def own_loads(instances: Iterable[CountedInstance]) -> dict[str, PeerLoad]:
    """This router's own counts, as its peers are told them (never below 0, which peers refuse)."""
    return {
        instance.name: PeerLoad(
            max(instance.own_in_flight, 0),
            max(instance.own_active_tokens, 0),
            max(instance.own_pending_prefill_tokens, 0),
        )
        for instance in instances
    }


class PeerLoads:
    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stale_after_s, self._clock = stale_after_s, clock
        self._latest: dict[str, tuple[float, Mapping[str, PeerLoad]]] = {}  # peer -> (heard at, its loads)

    @property
    def peers(self) -> int:
        """Peers heard from within stale_after_s."""
        return len(self._latest)

    def knows(self, peer: str) -> bool:
        return peer in self._latest

    def update(self, peer: str, loads: Mapping[str, PeerLoad]) -> None:
        self._latest[peer] = (self._clock(), loads)

    def expire(self) -> list[str]:
        """Forget peers not heard from lately: those forgotten."""
        oldest = self._clock() - self._stale_after_s
        stale = [peer for peer, (heard, _) in self._latest.items() if heard < oldest]
        for peer in stale:
            del self._latest[peer]
        return stale

    def apply(self, instances: Iterable[CountedInstance]) -> None:
        """Set each instance's peers' share to the sum of the latest snapshots; instances a peer does not
        name (its configuration differs) get nothing from it."""
        totals: dict[str, list[int]] = {}
        for _, loads in self._latest.values():
            for name, load in loads.items():
                total = totals.setdefault(name, [0, 0, 0])
                total[0] += load.in_flight
                total[1] += load.active_tokens
                total[2] += load.pending_prefill_tokens
        for instance in instances:
            summed = totals.get(instance.name)
            instance.peers = NO_PEER_LOAD if summed is None else PeerLoad(*summed)
