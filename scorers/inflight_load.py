"""In-flight load: fewer requests in flight through this router scores higher, or, counting context tokens,
less context in flight (the KV they hold, a shared prefix once: roughly what decode steps there read).

Scores are (max - n) / (max - min) over the candidates, as llm-d's queue scorer normalizes queue depth;
when all candidates carry the same load, all score 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from scorers._scores import loads, lower_is_better
from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import RoutingRequest


class InflightLoadParams(Params):
    count: Literal["requests", "context_tokens"] = Field(
        default="requests", description="what load is: requests, or the context tokens they hold"
    )


class InflightLoadScorer:
    def __init__(self, params: InflightLoadParams) -> None:
        self._tokens = params.count == "context_tokens"

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return lower_is_better(loads(candidates, self._tokens))


REGISTRATION: Registration[Scorer] = Registration(InflightLoadParams, InflightLoadScorer)
