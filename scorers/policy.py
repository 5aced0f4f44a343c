"""A policy: weighted scorers and a picker, built from its configuration."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Sequence

from scorers.candidate import Candidate
from scorers.pickers import Picker, ranked
from scorers.plugins import Observer, Scorer, WaitWeigher
from scorers.policy_config import PolicyConfig
from scorers.registry import PICKERS, SCORERS
from scorers.request import RoutingRequest
from scorers.ttft_model import TTFTFeatures


class Policy:
    def __init__(
        self,
        name: str,
        config: PolicyConfig,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        """clock: what scorers whose state expires (session affinity) read the time from; rng: what the
        picker breaks ties with (a seeded one makes a simulation repeat exactly)."""
        self.name, self.config = name, config
        self._clock, self._rng = clock, rng
        self._scorers: list[tuple[Scorer, float]] = [
            (SCORERS[spec.type].build(spec.params, clock), spec.weight) for spec in config.scorers
        ]
        self._picker: Picker = PICKERS[config.picker.type].build(config.picker.params, rng=rng)
        self._observers = [scorer for scorer, _ in self._scorers if isinstance(scorer, Observer)]
        self._wait_weighers = [scorer for scorer, _ in self._scorers if isinstance(scorer, WaitWeigher)]

    @functools.cached_property
    def prefill_leg(self) -> Policy:
        """The same policy choosing disaggregated requests' prefill instances, with state of its own: a
        session's affinity is to the decode instance of its last turn; each leg has its round-robin turn."""
        return Policy(self.name, self.config, self._clock, self._rng)

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> int:
        """The index of the chosen candidate; candidates is never empty."""
        chosen = 0 if len(candidates) == 1 else self._picker.pick(self._totals(request, candidates))
        for observer in self._observers:
            observer.observe(request, candidates[chosen])
        return chosen

    def behind_per_s(self, instances: int) -> float:
        """What the policy weighs the wait a request causes by over `instances` candidates (ttft-cost's
        wait_caused; scorers/plugins.py WaitWeigher): 0 when it does not count that wait."""
        return sum(weigher.behind_per_s(instances) for weigher in self._wait_weighers)

    def wait_charged_s(
        self, candidate: Candidate, features: TTFTFeatures, predicted_s: float, behind_per_s: float
    ) -> float:
        """What choosing candidate is charged for the wait it causes, at the weight behind_per_s gave."""
        return sum(w.charged_s(candidate, features, predicted_s, behind_per_s) for w in self._wait_weighers)

    def ranked(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[int]:
        """The candidates' indexes, best total score first, the observers untold: the order of the fallbacks
        a gateway tries when the chosen one fails (router/epp/)."""
        totals = ranked(self._totals(request, candidates))
        return sorted(range(len(candidates)), key=totals.__getitem__, reverse=True)

    def _totals(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        totals = [0.0] * len(candidates)
        for scorer, weight in self._scorers:
            for index, score in enumerate(scorer.score(request, candidates)):
                totals[index] += weight * score
        return totals
