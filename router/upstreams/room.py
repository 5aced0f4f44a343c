"""Which instances have room for one more request: the router's own bound on what it sends one instance, and,
where the engines refuse past a waiting-queue limit, a queue not near that limit. A request sent to a full
queue is refused before it runs and costs a retry; one sent to an instance with room is not.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.upstreams.instances import Instance
from scorers.request import RoutingRequest


def waiting(instance: Instance) -> float:
    """Requests waiting at instance, as best known: its queue at the last scrape, or what is in flight there
    beyond what it was running then (requests sent since), whichever is more. 0 before its first scrape."""
    load = instance.load
    if load is None:
        return 0.0
    return max(load.waiting, instance.in_flight - load.running)


def queue_near_full(instance: Instance, max_waiting: int) -> bool:
    # A few requests' headroom: the scraped queue is up to one scrape old, and other routers' requests (or
    # clients' sent straight to the engine) join it meanwhile.
    return waiting(instance) >= max_waiting - max(1, max_waiting // 16)


def with_room(
    instances: Sequence[Instance], per_instance_limit: int, max_waiting: int | None
) -> list[Instance]:
    """Those with fewer than per_instance_limit of this router's requests in flight and, with max_waiting
    (the engines' waiting-queue limit), a queue not near it. When every one with in-flight room has a queue
    near its limit, all those: the engines queue or refuse it, and a refusal is retried elsewhere."""
    open_ = [i for i in instances if i.own_in_flight < per_instance_limit]
    if max_waiting is None:
        return open_
    return [i for i in open_ if not queue_near_full(i, max_waiting)] or open_


class HasRoom:
    """The candidate filter (scorers/plugins.py Filter) of those with room for one more request."""

    def __init__(self, per_instance_limit: int, max_waiting: int | None) -> None:
        self.per_instance_limit, self._max_waiting = per_instance_limit, max_waiting

    def filter(self, request: RoutingRequest, candidates: list[Instance]) -> list[Instance]:
        return with_room(candidates, self.per_instance_limit, self._max_waiting)
