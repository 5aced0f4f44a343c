"""KV-cache usage: more free KV cache scores higher (llm-d's kv-cache-utilization-scorer).

Scores are 1 - vllm:kv_cache_usage_perc, clamped to [0, 1]. A candidate without load data scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import RoutingRequest


class KvUsageParams(Params):
    pass


class KvUsageScorer:
    def __init__(self, params: KvUsageParams) -> None:
        pass

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [0.0 if c.load is None else min(max(1.0 - c.load.kv_usage, 0.0), 1.0) for c in candidates]


REGISTRATION: Registration[Scorer] = Registration(KvUsageParams, KvUsageScorer)
