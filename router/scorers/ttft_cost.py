"""TTFT cost: each instance's predicted time to first token for this request, in seconds.

Prefix overlap, pool hits and queueing all become time on one scale (router/scoring/ttft_model.py), where the
weighted-sum policies add unitless scores. Scores are (fastest + r) / (predicted + r): the fastest
instance scores 1, so max-score picks the minimum and a softmax picker's temperature acts on relative
speed. r, the resolution, keeps differences of a few milliseconds (below what predictions can tell apart)
from looking like factors of two, which would make a session-affinity scorer's hysteresis useless.

With in_flight_exponent e > 0 each cost is (predicted + r) x (requests in flight + 1)^e before the ratio,
vllm-router kv_aware's multiplier on kvroute's prediction. When KV memory is saturated it sends long
prompts to the instances with few requests in flight, which hold long contexts already, and keeps the rest
clear for short ones: a lower median TTFT for a longer tail, the long prompts waiting there for memory
(docs/bench-simulate.md measures it). 0, the default, is the prediction alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from router.scoring.candidate import Candidate
from router.scoring.params import Params, Registration
from router.scoring.scorer import Scorer
from router.scoring.ttft_features import features_for
from router.types import RoutingRequest


class TTFTCostParams(Params):
    resolution_s: float = Field(
        default=0.05, ge=0, description="TTFT differences well below it are noise"
    )
    in_flight_exponent: float = Field(
        default=0.0, ge=0, le=4, description="costs x (requests in flight + 1) to this power"
    )


class TTFTCostScorer:
    def __init__(self, params: TTFTCostParams) -> None:
        self._resolution = params.resolution_s
        self._exponent = params.in_flight_exponent

    def predict(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [c.ttft_model.predict(features_for(request, c)) for c in candidates]

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        costs = [seconds + self._resolution for seconds in self.predict(request, candidates)]
        if not costs:
            return []
        if self._exponent:
            costs = [
                cost * (c.in_flight + 1) ** self._exponent
                for cost, c in zip(costs, candidates, strict=True)
            ]
        lowest = min(costs)
        return [min(1.0, lowest / cost) if cost > 0 else 1.0 for cost in costs]


REGISTRATION: Registration[Scorer] = Registration(TTFTCostParams, TTFTCostScorer)
