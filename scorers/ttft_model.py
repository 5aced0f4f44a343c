"""Time to first token, predicted per instance in seconds and calibrated from the TTFTs the router sees.

    TTFT = overhead
         + queue rate   x uncached prompt tokens of requests still prefilling there (the wait)
         + prefill rate x this prompt's tokens in neither its cache nor the pool (computed)
         + load rate    x this prompt's tokens it loads from the pool or its CPU tier (loaded)
         + transfer rate x this prompt's tokens it fetches from the prefill instance (a decode leg)
         + memory factor x the wait for KV memory, in seconds (admission)
         + attention rate x (computed token, earlier token) pairs of this prompt (long contexts)

The memory term is what long contexts cost in memory: an engine admits a request only when its context fits in
the KV cache beside those already there. With C tokens of KV capacity, A context tokens in flight and a prompt
of P, A + P - C tokens have to leave first; contexts leave at A / H tokens a second, H being how long a
context token stays (measured, router/upstreams/context_residency.py), so the wait is H x (A + P - C) / A.
Its factor is not calibrated: when memory frees up depends on when other requests finish, which no linear
term describes. The attention term is what they cost in compute: a computed token attends to every token
before it, so the same new tokens cost more after a long cached prefix than after a short one. It is on when
its prior is nonzero (0, the default, leaves it out), and calibrates from there.

Each instance has its own rates: hardware, model and parallelism differ across a fleet. They start from the
configured priors and follow observations by exponentially weighted least squares on relative error (a
TTFT's noise grows with it, and a 50 ms request matters as much as a 5 s one), pulled towards the priors
(ridge) so that a term the traffic has not exercised yet keeps its prior instead of drifting.
Instances of one fleet usually share hardware, and a few observations are noise: four answers that came
back fast whatever queued ahead of them once solved an instance's queue rate to zero, and the router then
sent it everything. So each instance's rates are pulled towards its fleet's (a model fed every instance's
observations) times the instance's measured slowdown against them, which count as fleet_weight
observations; an instance leaves them as its own evidence outweighs them (another GPU, another
parallelism), and the fleet's are pulled towards the configured priors.
Non-streamed answers arrive whole: their time includes decoding, which a decode term (per generated token)
absorbs while calibrating; predictions leave it out.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from pydantic import Field

from scorers import _ttft_kernel
from scorers._candidate_state import ModelRates, read_rates
from scorers.params import Params

TERMS = ("overhead", "queue", "prefill", "load", "memory", "decode", "attention", "transfer")
_QUEUE = TERMS.index("queue")
_PREFILL = TERMS.index("prefill")
_LOAD = TERMS.index("load")
_ATTENTION = TERMS.index("attention")
_MEMORY = TERMS.index("memory")
_TRANSFER = TERMS.index("transfer")
_PER_TOKEN = [_QUEUE, _LOAD, _TRANSFER]  # rates of work a token that follow the fleet's speed when unobserved
# Typical size of each feature: the priors count as prior_weight observations of this size, of the TTFT
# typical lately. The overhead's is larger than its feature's (1): on its own it would soak up the noise of
# the first few observations. Attention's: ~2K tokens computed after ~3K reused.
_SCALES = np.array([8.0, 2048.0, 2048.0, 2048.0, 0.25, 64.0, 2048.0 * 4096.0, 2048.0])
# How firmly each prior holds. The decode term's the least: predictions leave it out, it is there to take
# a whole answer's decoding, and its prior (an engine's decode speed) is the most often wrong. Whole answers
# decode about as many tokens each, so their decoding cannot be told from the fixed cost and a cached turn's
# few prompt tokens: held as firmly as the rest, a decode prior 20x too slow (10 ms a token where the fleet
# decoded 16 tokens in 8 ms) was taken out of the prefill and overhead rates as well, solving them below
# zero (0 once clamped) from one cached turn: a 9,000-token prompt computed anew was predicted to cost 0 s.
_STRENGTH = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.3, 1.0, 1.0])
# How an observation is folded in (robustly, on relative error) and when the rates are solved again (on the
# first 32 observations, then every 16: a 6x6 solve costs more than the rest of a routing decision, and rates
# that many requests old predict as well) are scorers/_ttft_kernel.pyx's Calibration and observe.


class TTFTPriors(Params):
    overhead_s: float = Field(default=0.005, ge=0, description="fixed cost of a request: HTTP, scheduling")
    queue_s_per_token: float = Field(default=1e-4, ge=0, description="per token prefilling ahead of it")
    prefill_s_per_token: float = Field(default=1e-4, ge=0, description="per prompt token computed")
    load_s_per_token: float = Field(default=4e-5, ge=0, description="per prompt token loaded from the pool")
    memory_wait_factor: float = Field(
        default=1.0, ge=0, description="x the wait for KV memory estimated from contexts in flight (fixed)"
    )
    decode_s_per_token: float = Field(default=0.01, ge=0, description="per generated token (calibration)")
    attention_s_per_pair: float = Field(
        default=0.0, ge=0, description="per (computed token, token before it) pair; 0 leaves the term out"
    )
    transfer_s_per_token: float = Field(
        default=2e-5, ge=0, description="per prompt token a decode leg fetches from its prefill instance"
    )
    calibrate: bool = Field(default=True, description="follow observed TTFTs; false keeps the priors")
    memory: float = Field(default=50.0, ge=1, description="observations that weigh in, about")
    prior_weight: float = Field(default=1.0, gt=0, description="the priors count as this many observations")
    fleet_weight: float = Field(
        default=16.0,
        ge=0,
        description="in each instance's calibration, its fleet's rates count as this many observations (0: "
        "each instance on its own, from the priors)",
    )

    def rates(self) -> np.ndarray:
        return np.array(
            [
                self.overhead_s,
                self.queue_s_per_token,
                self.prefill_s_per_token,
                self.load_s_per_token,
                self.memory_wait_factor,
                self.decode_s_per_token,
                self.attention_s_per_pair,
                self.transfer_s_per_token,
            ]
        )


class TTFTFeatures(NamedTuple):
    """What a request costs on an instance. A named tuple: a decision over 1,000 instances makes 1,000 of
    them, and a frozen dataclass took 1.7 µs to make each, a third of a candidate's scoring."""

    queued_tokens: int
    uncached_tokens: int
    loaded_tokens: int
    memory_wait_s: float = 0.0
    decoded_tokens: int = 0  # observations of non-streamed answers only
    attention_pairs: float = 0.0  # computed tokens x their positions: what their attention reads
    transferred_tokens: int = 0  # fetched from a prefill instance (a decode leg)


class TTFTModel(ModelRates):
    """A model of an instance's TTFT (or of a fleet's, which its instances' are pulled towards). Its rates,
    what they were solved from and its fleet are ModelRates' C fields, which the compiled scoring reads."""

    fleet: TTFTModel | None

    def __init__(self, priors: TTFTPriors, fleet: TTFTModel | None = None) -> None:
        """fleet: the model of the instance's fleet, which its observations feed too and whose rates it is
        pulled towards (priors.fleet_weight 0 leaves it out)."""
        self._calibrate = priors.calibrate
        self._prior = priors.rates()
        self.fleet = fleet if priors.fleet_weight > 0 else None
        self._fleet_weight = priors.fleet_weight
        self.fleet_solved = -1  # the fleet's solve this instance's rates were last solved against
        # The attention term is on when its prior is: where prefill does not slow with the context, its
        # calibration only fits noise, which moved the simulated fleet's tail both ways.
        self._terms = np.array(
            [i for i in range(len(TERMS)) if i != _ATTENTION or priors.attention_s_per_pair]
        )
        fleet = self.fleet
        if fleet is not None and (
            fleet._calibrate != self._calibrate or not np.array_equal(fleet._terms, self._terms)
        ):
            raise ValueError(
                "an instance's TTFT model and its fleet's calibrate the same terms, or neither does"
            )
        self._prior_weight = priors.prior_weight
        # The TTFT of a typical request, tracked: one computed whole, nothing fetched from a prefill instance.
        # It starts as the priors' and averages the observations with the prior counted as prior_weight of
        # them; the slowdown starts as the fleet_weight of a slowdown of 1.
        typical = np.arange(len(TERMS)) != _TRANSFER
        self._calibration = _ttft_kernel.Calibration(
            self._terms.tolist(),
            decay=1.0 - 1.0 / priors.memory,
            typical_s=float(self._prior[typical] @ _SCALES[typical]),
            typical_weight=self._prior_weight,
            speed_weight=priors.fleet_weight,
        )
        self._rates = self._prior.copy()
        self.rate_values = self._rates.tolist()  # as floats: predict's arithmetic, not numpy's
        self.observations = 0
        self.solved = 0  # the observations the rates were solved from

    @property
    def rates(self) -> dict[str, float]:
        return dict(zip(TERMS, self.current_rates(), strict=True))

    @property
    def queue_rate(self) -> float:
        """Seconds each uncached token prefilling there adds to the wait of the requests queued behind it."""
        return self.current_rates()[_QUEUE]

    def current_rates(self) -> list[float]:
        """The rates in TERMS' order, as floats (what the prediction's arithmetic reads), solved again when
        the fleet's have moved since: scorers/_candidate_state.pyx's current_rates, which the compiled
        scoring calls too."""
        return read_rates(self)

    def predict(self, features: TTFTFeatures) -> float:
        return _ttft_kernel.predict(self.current_rates(), features)

    def observe(self, features: TTFTFeatures, seconds: float) -> None:
        """An answer's TTFT, learnt by this model and its fleet's (scorers/_ttft_kernel.pyx's observe)."""
        # A wait for memory depends on when other requests finish, which no linear term describes: such
        # requests do not calibrate, and the memory term keeps its configured factor.
        if not self._calibrate or seconds <= 0 or features.memory_wait_s > 0:
            return
        # Robust: an observation far off the prediction counts as at most 4 times off, and past 0.5 of
        # relative error with a weight falling as the error grows (Huber). On plain relative error one 2 ms
        # answer where 0.8 s was due (a prompt cached that the index did not know) outweighed fifty sound ones
        # and zeroed the prefill rate for hundreds of requests. Rates far off still converge.
        # A fleet that slows down threefold must not find the priors three times as convincing: the typical
        # TTFT they are scaled by is an average of what was observed, from the first observations on, not
        # after ~memory of them (the priors' typical TTFT can be 20x the fleet's, which made them 400x too
        # weak and let four answers zero a rate).
        _ttft_kernel.observe(self, self._calibration, features, seconds)

    def _priors_at_fleet_speed(self) -> np.ndarray:
        """The priors, with the other per-token rates (queue, pool load, transfer) scaled down as far as the
        prefill rate has proved faster than its prior. A term the router never observes keeps its prior:
        one too pessimistic (a pool load priced as a TCP link's on an RDMA pool) keeps the router off that
        path for good, so nothing ever corrects it; one too optimistic sends requests down it, whose
        observations then correct it. Never scaled up: a slower fleet leaves them as configured."""
        prior_prefill = self._prior[_PREFILL]
        if not self._calibrate or prior_prefill <= 0 or self._rates[_PREFILL] >= prior_prefill:
            return self._prior
        target = self._prior.copy()
        target[_PER_TOKEN] *= self._rates[_PREFILL] / prior_prefill
        return target

    @property
    def slowdown(self) -> float:
        """How much slower than its fleet this instance answers (1: as fast; measured, in log space)."""
        return math.exp(self._calibration.log_speed)

    def _solve(self) -> None:
        # Towards the fleet's rates (times this instance's slowdown) once it has some, else the priors.
        fleet = self.fleet
        if fleet is not None:
            self.fleet_solved = fleet.solved
        if fleet is not None and fleet.observations:
            target, weight = fleet._rates * _scaled(self.slowdown), self._fleet_weight
        else:
            target, weight = self._priors_at_fleet_speed(), self._prior_weight
        # Priors far out of scale (1e300 s a token) underflow the penalty to a singular or overflowing system:
        # the rates it had stay rather than failing every request.
        gram, moment = self._calibration.sums()
        try:
            with np.errstate(all="ignore"):  # what overflows is not finite, and refused below
                scales = _SCALES[self._terms] / self._calibration.typical_s
                penalty = np.diag(weight * _STRENGTH[self._terms] * scales**2)
                system, right = np.array(gram) + penalty, np.array(moment) + penalty @ target[self._terms]
                solved = np.linalg.solve(system, right)
        except np.linalg.LinAlgError:
            return
        if not np.isfinite(solved).all():
            return
        self._rates[self._terms] = np.maximum(solved, 0.0)  # a negative rate would reward work
        self.rate_values = self._rates.tolist()
        self.solved = self.observations


class FleetModels:
    """The fleet models instances' TTFT models are pulled towards: one per role (prefill legs, decode legs
    and whole requests answer on different clocks), each made at its first instance."""

    def __init__(self, priors: TTFTPriors) -> None:
        self._priors = priors
        self._by_role: dict[str, TTFTModel] = {}

    def of(self, role: str) -> TTFTModel:
        model = self._by_role.get(role)
        if model is None:
            model = self._by_role[role] = TTFTModel(self._priors)
        return model


def _scaled(slowdown: float) -> np.ndarray:
    """Multipliers of the rates for an instance slowdown times slower: the memory factor is no rate."""
    factors = np.full(len(TERMS), slowdown)
    factors[_MEMORY] = 1.0
    return factors


def attention_pairs(start: int, tokens: int) -> float:
    """The (token, earlier or same token) pairs of computing `tokens` prompt tokens after `start` cached:
    each attends to every token before it and itself."""
    return _ttft_kernel.attention_pairs(start, tokens)
