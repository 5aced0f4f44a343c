"""A policy: weighted scorers and a picker, built from its configuration."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from scorers._scores import weighted_sum
from scorers.candidate import Candidate
from scorers.pickers import ranked
from scorers.plugins import Explainer, Picker, PickObserver, PlacementListener, ResponseObserver, Scorer
from scorers.policy_config import PolicyConfig
from scorers.registry import PICKERS, SCORERS
from scorers.request import RoutingRequest


@dataclass(slots=True)
class Pick:
    index: int  # of the chosen candidate
    explained: Mapping[str, float]  # the explainers' figures about the choice (scorers/plugins.py)
    totals: Sequence[float] = ()  # each candidate's total score it was chosen by (none: one candidate)


_NOTHING_EXPLAINED: Mapping[str, float] = {}


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
        self._weights = [weight for _, weight in self._scorers]
        self._picker: Picker = PICKERS[config.picker.type].build(config.picker.params, rng=rng)
        plugins = [scorer for scorer, _ in self._scorers]
        self._observers = [plugin for plugin in plugins if isinstance(plugin, PickObserver)]
        self._explainers = [plugin for plugin in plugins if isinstance(plugin, Explainer)]
        self._responders = [plugin for plugin in plugins if isinstance(plugin, ResponseObserver)]
        self._listeners = [plugin for plugin in plugins if isinstance(plugin, PlacementListener)]

    @functools.cached_property
    def prefill_leg(self) -> Policy:
        """The same policy choosing disaggregated requests' prefill instances, with state of its own: a
        session's affinity is to the decode instance of its last turn; each leg has its round-robin turn."""
        return Policy(self.name, self.config, self._clock, self._rng)

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> int:
        """The index of the chosen candidate; candidates is never empty."""
        return self.pick(request, candidates).index

    def pick(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Pick:
        """The chosen candidate and what the explainers say of the choice; the observers are told it."""
        totals = () if len(candidates) == 1 else self._totals(request, candidates)
        chosen = self._picker.pick(totals) if totals else 0
        explained = _NOTHING_EXPLAINED
        if self._explainers:
            explained = {}
            for explainer in self._explainers:
                explained.update(explainer.explain(request, len(candidates), candidates[chosen]))
        for observer in self._observers:
            observer.observe(request, candidates[chosen])
        return Pick(chosen, explained, totals)

    def predict(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> int:
        """The index of the candidate the policy would choose for request now, by its scores alone: no
        picker's draw and no observer told, since nothing is chosen (a program's next turn, foreseen)."""
        if len(candidates) == 1:
            return 0
        return best_first(self._totals(request, candidates))[0]

    def placed_elsewhere(self, session_key: str, instance: str) -> None:
        """Another replica placed a turn of the session at instance (router/shared/)."""
        for listener in self._listeners:
            listener.placed_elsewhere(session_key, instance)

    def responded(
        self, request: RoutingRequest, chosen: Candidate, ttft_s: float | None, status: int
    ) -> None:
        """After a response: the plugins that learn from answers are told it."""
        for responder in self._responders:
            responder.responded(request, chosen, ttft_s, status)

    def _totals(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        if not self._scorers:
            return [0.0] * len(candidates)
        return weighted_sum([scorer.score(request, candidates) for scorer, _ in self._scorers], self._weights)


def best_first(totals: Sequence[float]) -> list[int]:
    """The candidates' indexes by a pick's totals, best first (a non-finite total last): the order of the
    fallbacks a gateway tries when the chosen one fails (router/epp/), ranked by the scores the choice was
    made from rather than scored again."""
    scores = ranked(totals)
    return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
