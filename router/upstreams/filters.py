"""The candidate filters (scorers/plugins.py Filter): which instances may take an attempt, in this order.

Healthy ones serving the request's leg, those whose circuit breaker lets a request through (soft: when every
healthy one's breaker is open the breakers step aside, as Envoy's panic mode, so that a client whose requests
make every engine fail cannot black out the model for everyone), and those with room for one more request of
this router (router/upstreams/room.py HasRoom). Memory is not a filter: a request the fleet has no KV
memory for waits for it (router/dispatch/wait/memory_gate.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from router.config import Role
from scorers.plugins import Filter
from scorers.request import RoutingRequest


class _Breaker(Protocol):
    def allows(self) -> bool: ...


class Checked(Protocol):
    """What these filters read of an instance (router/upstreams/instances.py Instance)."""

    @property
    def healthy(self) -> bool: ...

    @property
    def role(self) -> Role: ...

    @property
    def breaker(self) -> _Breaker: ...


InstanceT = TypeVar("InstanceT", bound=Checked)

_OTHER_LEG: dict[Role, Role | None] = {"decode": "prefill", "prefill": "decode", "both": None}


class Healthy:
    """Instances that answer their health checks and take the leg: of a disaggregated model, a decode leg is
    also where a whole request goes."""

    def __init__(self, leg: Role) -> None:
        self._other = _OTHER_LEG[leg]

    def filter(self, request: RoutingRequest, candidates: list[InstanceT]) -> list[InstanceT]:
        other = self._other
        return [i for i in candidates if i.healthy and i.role != other]


class BreakerAllows:
    """Soft: instances whose circuit breaker lets a request through, or all when none does."""

    def filter(self, request: RoutingRequest, candidates: list[InstanceT]) -> list[InstanceT]:
        return [i for i in candidates if i.breaker.allows()] or candidates


HEALTHY: dict[Role, tuple[Healthy, BreakerAllows]] = {
    leg: (Healthy(leg), BreakerAllows()) for leg in ("prefill", "decode", "both")
}  # by leg: which instances may serve it at all, room aside


def filtered(
    filters: Sequence[Filter[InstanceT]], request: RoutingRequest, candidates: list[InstanceT]
) -> list[InstanceT]:
    """candidates through filters in order."""
    for candidate_filter in filters:
        if not candidates:
            break
        candidates = candidate_filter.filter(request, candidates)
    return candidates
