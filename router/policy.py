"""A policy: weighted scorers and a picker, built from its configuration."""

from __future__ import annotations

from collections.abc import Sequence

from router.config import PolicyConfig
from router.pickers import Picker
from scorers.base import Candidate, RoutingRequest, Scorer
from scorers.registry import PICKERS, SCORERS


class Policy:
    def __init__(self, name: str, config: PolicyConfig) -> None:
        self.name = name
        self._scorers: list[tuple[Scorer, float]] = [
            (SCORERS[spec.type].build(spec.params), spec.weight) for spec in config.scorers
        ]
        self._picker: Picker = PICKERS[config.picker.type].build(config.picker.params)

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> int:
        """The index of the chosen candidate; candidates is never empty."""
        if len(candidates) == 1:
            return 0
        totals = [0.0] * len(candidates)
        for scorer, weight in self._scorers:
            for index, score in enumerate(scorer.score(request, candidates)):
                totals[index] += weight * score
        return self._picker.pick(totals)
