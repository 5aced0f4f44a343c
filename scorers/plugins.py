"""The extension points, named in one place as llm-d's scheduler framework names them.

A request's way through a policy: the router's **filters** keep the candidates that may take it (healthy,
circuit breaker, prefill/decode role, room: router/upstreams/filters.py); each **scorer** gives every
candidate a score in [0, 1]; the policy adds them by weight and its **picker** chooses one. **After a pick**,
the plugins that learn from decisions are told the choice (session affinity, arrival rates), and those that
explain it report figures of their own (the wait a choice was charged for). **After a response**, plugins
that learn from answers are told what came back.

Where each is registered: scorers and pickers by YAML `type` in scorers/registry.py; filters by the router,
in order, in router/upstreams/filters.py. Hooks are found by the protocols they implement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar, runtime_checkable

from scorers.candidate import Candidate
from scorers.request import RoutingRequest

C = TypeVar("C")

# The figures an Explainer reports, as the router publishes them (a header, a gauge): the wait the chosen
# candidate was charged for causing those arriving behind it, and the weight that wait had.
WAIT_CAUSED_S = "wait_caused_s"
WAIT_CAUSED_WEIGHT = "wait_caused_weight"


class Filter(Protocol[C]):
    """Keeps the candidates that may take the request, in their order. A filter that would keep none may
    keep all it was given instead (a soft filter: the circuit breakers step aside when all are open)."""

    def filter(self, request: RoutingRequest, candidates: list[C]) -> list[C]: ...


class Scorer(Protocol):
    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        """One score per candidate, in [0, 1], higher is better."""
        ...


class Picker(Protocol):
    def pick(self, scores: Sequence[float]) -> int:
        """The index of the chosen candidate; scores is never empty."""
        ...


@runtime_checkable
class PickObserver(Protocol):
    """After a pick: a plugin that learns from decisions (session affinity, arrival rates) is told the
    chosen candidate."""

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None: ...


@runtime_checkable
class PlacementListener(Protocol):
    """A plugin that learns where another router (a replica sharing the store) placed a session's turn."""

    def placed_elsewhere(self, session_key: str, instance: str) -> None: ...


@runtime_checkable
class Explainer(Protocol):
    """After a pick, before the observers learn of it: figures of the plugin's own about the choice, by name
    (WAIT_CAUSED_S...), that the router shows on the answer and in its metrics."""

    def explain(self, request: RoutingRequest, candidates: int, chosen: Candidate) -> Mapping[str, float]: ...


@runtime_checkable
class ResponseObserver(Protocol):
    """After a response: a plugin that learns from answers is told the instance's time to its first byte
    (None: no answer came, or not one that times a prefill) and the status."""

    def responded(
        self, request: RoutingRequest, chosen: Candidate, ttft_s: float | None, status: int
    ) -> None: ...
