"""Token cost: the work an instance would do for this request, and the work already there, in tokens.

    cost = uncached prompt tokens of requests still prefilling there (the prefill queue ahead)
         + this prompt's tokens it does not hold (matched blocks credited by tier)
         + decode_weight x context tokens of all its requests in flight (decode pressure)

Scores are cheapest cost / cost (plus one token, so an idle, fully cached instance is not a division by
zero): the cheapest instance scores 1 and a score says how many times dearer the others are, so a small
difference in tokens stays a small difference in score. Prefix and load are weighed in one
unit, as Dynamo's cost does, where a weighted sum of separately normalized prefix and load scores cannot:
a shared system prompt held by one busy instance stops attracting new sessions once its load costs more
than recomputing the prompt elsewhere, while a session whose history keeps growing stays where it is cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import NO_MATCH, RoutingRequest


class TokenCostParams(Params):
    gpu_credit: float = Field(
        default=1.0, ge=0.0, le=1.0, description="what a block in the instance's GPU counts"
    )
    cpu_credit: float = Field(default=0.8, ge=0.0, le=1.0, description="a block in its CPU offload tier")
    pool_credit: float = Field(default=0.6, ge=0.0, le=1.0, description="a block in the shared Mooncake pool")
    decode_weight: float = Field(
        default=0.25, ge=0.0, description="prefill tokens one in-flight context token is worth"
    )


class TokenCostScorer:
    def __init__(self, params: TokenCostParams) -> None:
        self._credits = (params.gpu_credit, params.cpu_credit, params.pool_credit)
        self._decode_weight = params.decode_weight

    def costs(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        gpu, cpu, pool = self._credits
        costs = []
        for candidate in candidates:
            match = request.matches.get(candidate.name, NO_MATCH)
            saved = (match.gpu * gpu + match.cpu * cpu + match.pool * pool) * request.block_size
            queued = candidate.pending_prefill_tokens + self._decode_weight * candidate.active_tokens
            costs.append(queued + max(request.prompt_tokens - saved, 0.0))
        return costs

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        costs = self.costs(request, candidates)
        if not costs:
            return []
        cheapest = min(costs) + 1.0
        return [cheapest / (cost + 1.0) for cost in costs]


REGISTRATION: Registration[Scorer] = Registration(TokenCostParams, TokenCostScorer)
