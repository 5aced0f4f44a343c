"""Round robin: the next candidate in turn scores 1, every other 0."""

from __future__ import annotations

from collections.abc import Sequence

from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import RoutingRequest


class RoundRobinParams(Params):
    pass


class RoundRobinScorer:
    def __init__(self, params: RoundRobinParams) -> None:
        self._turn = 0

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        scores = [0.0] * len(candidates)
        if candidates:
            scores[self._turn % len(candidates)] = 1.0
        return scores

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None:
        """A pick was made: the turn passes (scoring alone, a prediction, moves nothing)."""
        self._turn += 1


REGISTRATION: Registration[Scorer] = Registration(RoundRobinParams, RoundRobinScorer)
