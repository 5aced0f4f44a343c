"""What every scorer promises: candidates in, one score in [0, 1] per candidate out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from scorers.candidate import Candidate
from scorers.request import RoutingRequest
from scorers.ttft_model import TTFTFeatures


class Scorer(Protocol):
    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        """One score per candidate, in [0, 1], higher is better."""
        ...


def lower_is_better(values: Sequence[float | None]) -> list[float]:
    """llm-d's normalization: (max - v) / (max - min) over the known values; equal ones all score 1;
    an unknown value (None) scores 0."""
    known = [v for v in values if v is not None]
    if not known:
        return [0.0] * len(values)
    low, high = min(known), max(known)
    span = high - low
    return [0.0 if v is None else 1.0 if span == 0 else (high - v) / span for v in values]


@runtime_checkable
class Observer(Protocol):
    """A scorer that learns from decisions (session affinity): told the chosen instance after each pick."""

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None: ...


@runtime_checkable
class WaitWeigher(Protocol):
    """A scorer that charges a request the wait it causes the requests arriving behind it (ttft-cost's
    wait_caused): it tells what it weighs that wait by, so the policy can show it."""

    def behind_per_s(self, instances: int) -> float:
        """Requests expected to arrive behind a request at one of `instances`, per second it spends there
        before its first token (0: the wait caused is not counted)."""
        ...

    def charged_s(
        self, candidate: Candidate, features: TTFTFeatures, predicted_s: float, behind_per_s: float
    ) -> float:
        """What the request is charged there for the wait it causes, weighed by behind_per_s."""
        ...
