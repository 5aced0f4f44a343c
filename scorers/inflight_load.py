"""In-flight load: fewer requests in flight through this router scores higher.

Scores are (max - n) / (max - min) over the candidates, as llm-d's queue scorer normalizes queue depth;
when all candidates carry the same load, all score 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from scorers.base import Candidate, Params, Registration, RoutingRequest, Scorer, lower_is_better


class InflightLoadParams(Params):
    pass


class InflightLoadScorer:
    def __init__(self, params: InflightLoadParams) -> None:
        pass

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return lower_is_better([c.in_flight for c in candidates])

REGISTRATION: Registration[Scorer] = Registration(InflightLoadParams, InflightLoadScorer)
