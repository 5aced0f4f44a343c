"""Precise prefix: the share of the prompt's blocks an instance already holds, from the KV-event index.

Each matched block is credited by the tier it sits in: a local GPU block saves its whole prefill, a block in
CPU offload or in the shared pool must still be loaded. Defaults follow vllm-router's kv_aware credits
(host 0.8, external pool 0.6).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import NO_MATCH, RoutingRequest


class PrecisePrefixParams(Params):
    gpu_credit: float = Field(
        default=1.0, ge=0.0, le=1.0, description="what a block in the instance's GPU counts"
    )
    cpu_credit: float = Field(default=0.8, ge=0.0, le=1.0, description="a block in its CPU offload tier")
    pool_credit: float = Field(default=0.6, ge=0.0, le=1.0, description="a block in the shared Mooncake pool")


class PrecisePrefixScorer:
    def __init__(self, params: PrecisePrefixParams) -> None:
        self._credits = (params.gpu_credit, params.cpu_credit, params.pool_credit)

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        if request.prompt_blocks <= 0:
            return [0.0] * len(candidates)
        gpu, cpu, pool = self._credits
        scores = []
        for candidate in candidates:
            match = request.matches.get(candidate.name, NO_MATCH)
            credited = match.gpu * gpu + match.cpu * cpu + match.pool * pool
            scores.append(min(credited / request.prompt_blocks, 1.0))
        return scores


REGISTRATION: Registration[Scorer] = Registration(PrecisePrefixParams, PrecisePrefixScorer)
