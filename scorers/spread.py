"""Spread: where costs tie, the instance placed on least lately and with the most KV memory free.

New sessions and short prompts cost about the same everywhere, and a random choice between equals lets
the fleet's caches fill unevenly: one instance takes a run of new sessions, their next turns stay there,
and its queue grows while another's memory sits empty. Weighted low, this scorer decides only near-ties:
half of its score is the placements each candidate received lately (each counts half after half_life_s),
half its KV memory in use (the contexts in flight there, or the engine's reported usage when that is
more), both normalized as llm-d normalizes queue depth: the least placed and the emptiest score 1. Counts
decay continuously, so of instances given as many requests the one given its last longest ago wins: ties
rotate over the fleet instead of falling at random.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pydantic import Field

from scorers._scores import spread_scores
from scorers.candidate import Candidate
from scorers.decaying_count import DecayingCount
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import RoutingRequest

_FORGOTTEN = 0.01  # placements decayed below this are dropped when the table grows (instances come and go)
_PRUNE_AT = 1024


class SpreadParams(Params):
    half_life_s: float = Field(default=10.0, gt=0, description="a placement counts half after this long")


class SpreadScorer:
    def __init__(self, params: SpreadParams, clock: Callable[[], float] = time.monotonic) -> None:
        self._half_life_s, self._clock = params.half_life_s, clock
        self._placed: dict[str, DecayingCount] = {}

    def placements(self, name: str, now: float | None = None) -> float:
        """The placements on name lately, each weighing half as much every half_life_s."""
        count = self._placed.get(name)
        return 0.0 if count is None else count.at(self._clock() if now is None else now)

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return spread_scores(candidates, self._placed, self._clock())

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None:
        now = self._clock()
        count = self._placed.get(chosen.name)
        if count is None:
            count = self._placed[chosen.name] = DecayingCount(self._half_life_s, now)
        count.add(now)
        if len(self._placed) > _PRUNE_AT:
            self._placed = {name: c for name, c in self._placed.items() if c.at(now) >= _FORGOTTEN}


REGISTRATION: Registration[Scorer] = Registration(SpreadParams, SpreadScorer, clocked=True)
