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
        self._scored: RoutingRequest | None = None  # the request scored last, until its pick is observed

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        scores = [0.0] * len(candidates)
        if candidates:
            scores[self._turn % len(candidates)] = 1.0
        self._scored = request
        return scores

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None:
        """A pick among the candidates it scored was made: the turn passes. A prediction (scored, never
        picked) moves nothing, nor does a pick of the only candidate, which is not scored (a retry's last
        instance): the next request then starts where the turn stood."""
        if self._scored is request:
            self._turn += 1
        self._scored = None


REGISTRATION: Registration[Scorer] = Registration(RoundRobinParams, RoundRobinScorer)
