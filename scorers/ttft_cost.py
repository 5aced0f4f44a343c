"""TTFT cost: each instance's predicted time to first token for this request, in seconds.

Prefix overlap, pool hits and queueing all become time on one scale (scorers/ttft_model.py), where the
weighted-sum policies add unitless scores. Scores are (fastest + r) / (predicted + r): the fastest
instance scores 1, so max-score picks the minimum and a softmax picker's temperature acts on relative
speed. r, the resolution, keeps differences of a few milliseconds (below what predictions can tell apart)
from looking like factors of two, which would make a session-affinity scorer's hysteresis useless.

With wait_caused w > 0 each cost also counts the wait the request causes the requests that arrive there
behind it: they queue behind its uncached tokens (its queue term: queue rate x those tokens) for as long as
it waits and prefills, during which about (arrivals a second / instances) x its predicted TTFT arrive. The
arrival rate is measured (placements, decayed with half-life arrivals_half_life_s), so the term adapts to
load: nothing on an idle fleet, where each request's own TTFT is all that matters; at high load a prompt that
would compute again what another instance holds costs the queue it builds, and the prefix's instance wins
unless it is much slower. The charge is at most wait_caused_cap x the request's own predicted TTFT: the router
sends later arrivals elsewhere, so the count is an upper bound, and it grows with the square of a prompt's
length. Uncapped, a long prompt waited for KV memory at its prefix's instance while an idle one would have
taken it sooner (the Mooncake trace's TTFT p99, docs/notes/simulate-investigations.md, "The suite").

With in_flight_exponent e > 0 each cost is (predicted + r) x (requests in flight + 1)^e before the ratio,
vllm-router kv_aware's multiplier on kvroute's prediction. When KV memory is saturated it sends long
prompts to the instances with few requests in flight, which hold long contexts already, and keeps the rest
clear for short ones: a lower median TTFT for a longer tail, the long prompts waiting there for memory
(docs/bench-simulate.md measures it). 0, the default, is the prediction alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import Field

from scorers import _ttft_kernel
from scorers._scores import loads
from scorers.candidate import Candidate
from scorers.decaying_count import DecayingCount
from scorers.params import Params, Registration
from scorers.plugins import WAIT_CAUSED_S, WAIT_CAUSED_WEIGHT, Scorer
from scorers.request import RoutingRequest


class TTFTCostParams(Params):
    resolution_s: float = Field(default=0.05, ge=0, description="TTFT differences well below it are noise")
    in_flight_exponent: float = Field(
        default=0.0, ge=0, le=4, description="costs x (requests in flight + 1) to this power"
    )
    wait_caused: float = Field(
        default=0.0,
        ge=0,
        le=16,
        description="x the wait the request causes the requests arriving behind it (0: left out)",
    )
    wait_caused_cap: float = Field(
        default=0.5,
        ge=0,
        description="the wait caused is charged at most this times the request's own predicted TTFT",
    )
    arrivals_half_life_s: float = Field(
        default=10.0, gt=0, description="the measured arrival rate forgets at this half-life"
    )


@dataclass(slots=True)
class _Weighed:
    request: RoutingRequest
    candidates: Sequence[Candidate]
    charges: list[float]
    behind_per_s: float


class TTFTCostScorer:
    def __init__(self, params: TTFTCostParams, clock: Callable[[], float] = time.monotonic) -> None:
        self._resolution = params.resolution_s
        self._exponent = params.in_flight_exponent
        self._wait_caused, self._wait_caused_cap = params.wait_caused, params.wait_caused_cap
        self._clock = clock
        self._arrivals = DecayingCount(params.arrivals_half_life_s, clock())
        self._weighed: _Weighed | None = None  # the last costs' charges, for explain to report

    def predict(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return _ttft_kernel.costs(request, candidates, 0.0, 0.0)[0]

    def arrivals_per_s(self) -> float:
        """Requests a second, measured from the decisions (one counts half after arrivals_half_life_s)."""
        return self._arrivals.rate_per_s(self._clock())

    def behind_per_s(self, instances: int) -> float:
        """The requests expected to arrive behind a request at one of `instances`, per second it waits and
        prefills there (x wait_caused): what the wait it causes is weighed by. 0 when the term is off."""
        if not self._wait_caused or instances <= 0:
            return 0.0
        return self._wait_caused * self.arrivals_per_s() / instances

    def costs(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        """Each candidate's cost in seconds: its predicted TTFT, plus the wait it causes when counted: the
        requests behind it, queued behind its uncached tokens (its queue rate x those tokens) for as long as
        it is predicted to take, at most wait_caused_cap x that prediction."""
        behind_per_s = self.behind_per_s(len(candidates))
        costs, charges = _ttft_kernel.costs(request, candidates, behind_per_s, self._wait_caused_cap)
        self._keep_charges(request, candidates, charges, behind_per_s)
        return costs

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        """Relative speeds (the module's docstring) of costs(request, candidates)."""
        factors = None
        if self._exponent:
            factors = [(requests + 1) ** self._exponent for requests in loads(candidates, False)]
        behind_per_s = self.behind_per_s(len(candidates))
        scores, charges = _ttft_kernel.speed_scores(
            request, candidates, behind_per_s, self._wait_caused_cap, self._resolution, factors
        )
        self._keep_charges(request, candidates, charges, behind_per_s)
        return scores

    def _keep_charges(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        charges: list[float] | None,
        behind_per_s: float,
    ) -> None:
        if charges is not None:
            self._weighed = _Weighed(request, candidates, charges, behind_per_s)

    def explain(self, request: RoutingRequest, candidates: int, chosen: Candidate) -> Mapping[str, float]:
        """The wait the chosen candidate was charged for causing, and its weight, as the choice weighed them
        (before the choice counts among the arrivals)."""
        weighed, self._weighed = self._weighed, None
        if weighed is not None and weighed.request is request and len(weighed.candidates) == candidates:
            for candidate, charged in zip(weighed.candidates, weighed.charges, strict=True):
                if candidate is chosen:
                    return {WAIT_CAUSED_S: charged, WAIT_CAUSED_WEIGHT: weighed.behind_per_s}
        behind_per_s = self.behind_per_s(candidates)
        if not behind_per_s:
            return {WAIT_CAUSED_S: 0.0, WAIT_CAUSED_WEIGHT: 0.0}
        _, charges = _ttft_kernel.costs(request, (chosen,), behind_per_s, self._wait_caused_cap)
        assert charges is not None
        return {WAIT_CAUSED_S: charges[0], WAIT_CAUSED_WEIGHT: behind_per_s}

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None:
        self._arrivals.add(self._clock())


REGISTRATION: Registration[Scorer] = Registration(TTFTCostParams, TTFTCostScorer, clocked=True)
