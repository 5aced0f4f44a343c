"""Pickers turn the policy's combined scores into one choice."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from pydantic import Field

from scorers._scores import tied_for_best
from scorers.params import Params, Registration
from scorers.plugins import Picker


class MaxScoreParams(Params):
    pass


def ranked(scores: Sequence[float]) -> list[float]:
    """scores with the non-finite ones (a scorer's overflow) lowest: a bad scorer must not crash routing."""
    return [s if math.isfinite(s) else -math.inf for s in scores]


class MaxScorePicker:
    """The highest score wins; ties are broken at random so equal instances share the load."""

    def __init__(self, params: MaxScoreParams, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, scores: Sequence[float]) -> int:
        tied = tied_for_best(list(scores))
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


class SoftmaxParams(Params):
    temperature: float = Field(default=0.1, gt=0, description="lower is closer to max-score")


class SoftmaxPicker:
    """Samples with probability proportional to exp(score / temperature)."""

    def __init__(self, params: SoftmaxParams, rng: random.Random | None = None) -> None:
        self._temperature = params.temperature
        self._rng = rng or random.Random()

    def pick(self, scores: Sequence[float]) -> int:
        scores = ranked(scores)
        best = max(scores)
        if best == -math.inf:  # nothing finite to weigh
            return self._rng.randrange(len(scores))
        weights = [math.exp((s - best) / self._temperature) for s in scores]
        return self._rng.choices(range(len(scores)), weights=weights)[0]


MAX_SCORE: Registration[Picker] = Registration(MaxScoreParams, MaxScorePicker, randomized=True)
SOFTMAX: Registration[Picker] = Registration(SoftmaxParams, SoftmaxPicker, randomized=True)
