"""TTFT cost: each instance's predicted time to first token for this request, in seconds.

Prefix overlap, pool hits and queueing all become time on one scale (scorers/ttft_model.py), where the
weighted-sum policies add unitless scores. Scores are (fastest + r) / (predicted + r): the fastest
instance scores 1, so max-score picks the minimum and a softmax picker's temperature acts on relative
speed. r, the resolution, keeps differences of a few milliseconds (below what predictions can tell apart)
from looking like factors of two, which would make a session-affinity scorer's hysteresis useless.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from scorers.base import Candidate, Params, Registration, RoutingRequest, Scorer
from scorers.ttft_model import features_for


class TTFTCostParams(Params):
    resolution_s: float = Field(
        default=0.05, ge=0, description="TTFT differences well below it are noise"
    )


class TTFTCostScorer:
    def __init__(self, params: TTFTCostParams) -> None:
        self._resolution = params.resolution_s

    def predict(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [c.ttft_model.predict(features_for(request, c)) for c in candidates]

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        predicted = self.predict(request, candidates)
        if not predicted:
            return []
        fastest = min(predicted) + self._resolution
        return [
            min(1.0, fastest / (seconds + self._resolution)) if seconds > 0 else 1.0
            for seconds in predicted
        ]


REGISTRATION: Registration[Scorer] = Registration(TTFTCostParams, TTFTCostScorer)
