"""Queue depth: fewer requests waiting in the engine scores higher (llm-d's queue-scorer).

Scores are (max - q) / (max - min) over vllm:num_requests_waiting of the candidates whose load is known;
when those all wait equally, all score 1. A candidate without load data scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from scorers._scores import lower_is_better
from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import RoutingRequest


class QueueDepthParams(Params):
    pass


class QueueDepthScorer:
    def __init__(self, params: QueueDepthParams) -> None:
        pass

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return lower_is_better([None if c.load is None else c.load.waiting for c in candidates])


REGISTRATION: Registration[Scorer] = Registration(QueueDepthParams, QueueDepthScorer)
