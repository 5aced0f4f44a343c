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
Non-streamed answers arrive whole: their time includes decoding, which a decode term (per generated token)
absorbs while calibrating; predictions leave it out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import Field

from router.scoring.params import Params

TERMS = ("overhead", "queue", "prefill", "load", "memory", "decode", "attention", "transfer")
_ATTENTION = TERMS.index("attention")
_TRANSFER = TERMS.index("transfer")
# Typical size of each feature: the priors count as prior_weight observations of this size, of the TTFT
# typical lately. The overhead's is larger than its feature's (1): on its own it would soak up the noise of
# the first few observations. Attention's: ~2K tokens computed after ~3K reused.
_SCALES = np.array([8.0, 2048.0, 2048.0, 2048.0, 0.25, 64.0, 2048.0 * 4096.0, 2048.0])
_SHORTEST_S = 1e-3  # relative errors of faster observations are weighed as if they took this long
_MAX_SURPRISE = 4.0  # an observed TTFT counts as at most this many times off the prediction
_HUBER_DELTA = 0.5  # relative errors beyond this weigh less and less
# The sums take every observation, the rates are solved from them on the first ones and then every this many
# (a 6x6 solve costs more than the rest of a routing decision; rates that many requests old predict as well).
_SOLVE_EVERY = 16
_SOLVE_EACH_UNTIL = 32


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

    def rates(self) -> np.ndarray:
        return np.array([
            self.overhead_s, self.queue_s_per_token, self.prefill_s_per_token, self.load_s_per_token,
            self.memory_wait_factor, self.decode_s_per_token, self.attention_s_per_pair,
            self.transfer_s_per_token,
        ])  # fmt: skip


@dataclass(frozen=True, slots=True)
class TTFTFeatures:
    queued_tokens: int
    uncached_tokens: int
    loaded_tokens: int
    memory_wait_s: float = 0.0
    decoded_tokens: int = 0  # observations of non-streamed answers only
    attention_pairs: float = 0.0  # computed tokens x their positions: what their attention reads
    transferred_tokens: int = 0  # fetched from a prefill instance (a decode leg)

    def vector(self) -> np.ndarray:
        return np.array([
            1.0, self.queued_tokens, self.uncached_tokens, self.loaded_tokens, self.memory_wait_s,
            self.decoded_tokens, self.attention_pairs, self.transferred_tokens,
        ])  # fmt: skip


class TTFTModel:
    def __init__(self, priors: TTFTPriors) -> None:
        self._calibrate = priors.calibrate
        self._prior = priors.rates()
        # The attention term is on when its prior is: where prefill does not slow with the context, its
        # calibration only fits noise, which moved the simulated fleet's tail both ways.
        self._terms = np.array(
            [i for i in range(len(TERMS)) if i != _ATTENTION or priors.attention_s_per_pair]
        )
        self._decay = 1.0 - 1.0 / priors.memory
        self._prior_weight = priors.prior_weight
        # The TTFT of a typical request, tracked: one computed whole, nothing fetched from a prefill instance.
        typical = np.arange(len(TERMS)) != _TRANSFER
        self._typical_s = float(self._prior[typical] @ _SCALES[typical])
        self._gram = np.zeros((len(self._terms), len(self._terms)))  # decayed sums of x x^T and of x y
        self._moment = np.zeros(len(self._terms))
        self._rates = self._prior.copy()
        self.observations = 0
        self.solved = 0  # the observations the rates were solved from

    @property
    def rates(self) -> dict[str, float]:
        return dict(zip(TERMS, self._rates.tolist(), strict=True))

    def predict(self, features: TTFTFeatures) -> float:
        rates = self._rates
        return float(
            rates[0]
            + rates[1] * features.queued_tokens
            + rates[2] * features.uncached_tokens
            + rates[3] * features.loaded_tokens
            + rates[4] * features.memory_wait_s
            + rates[_ATTENTION] * features.attention_pairs
            + rates[_TRANSFER] * features.transferred_tokens
        )

    def observe(self, features: TTFTFeatures, seconds: float) -> None:
        # A wait for memory depends on when other requests finish, which no linear term describes: such
        # requests do not calibrate, and the memory term keeps its configured factor.
        if not self._calibrate or seconds <= 0 or features.memory_wait_s > 0:
            return
        # Robust: an observation far off the prediction counts as at most _MAX_SURPRISE times off, and past
        # _HUBER_DELTA of relative error with a weight falling as the error grows (Huber). On plain relative
        # error one 2 ms answer where 0.8 s was due (a prompt cached that the index did not know) outweighed
        # fifty sound ones and zeroed the prefill rate for hundreds of requests. Rates far off still converge.
        x = features.vector()[self._terms]
        weight = 1.0
        predicted = float(self._rates[self._terms] @ x)  # with the decoding a whole answer includes
        if predicted > 0:
            seconds = min(max(seconds, predicted / _MAX_SURPRISE), predicted * _MAX_SURPRISE)
            error = abs(predicted - seconds) / seconds
            weight = min(1.0, _HUBER_DELTA / error) if error else 1.0
        y = max(seconds, _SHORTEST_S)
        x = x / y  # relative error: divide the equation by y
        self._gram = self._decay * self._gram + weight * np.outer(x, x)
        self._moment = self._decay * self._moment + weight * x * (seconds / y)
        # A fleet that slows down threefold must not find the priors three times as convincing.
        self._typical_s = self._decay * self._typical_s + (1 - self._decay) * seconds
        self.observations += 1
        if self.observations <= _SOLVE_EACH_UNTIL or self.observations % _SOLVE_EVERY == 0:
            self._solve()

    def _solve(self) -> None:
        # Priors far out of scale (1e300 s a token) underflow the penalty to a singular or overflowing system:
        # the rates it had stay rather than failing every request.
        try:
            with np.errstate(all="ignore"):  # what overflows is not finite, and refused below
                penalty = np.diag(self._prior_weight * (_SCALES[self._terms] / self._typical_s) ** 2)
                solved = np.linalg.solve(
                    self._gram + penalty, self._moment + penalty @ self._prior[self._terms]
                )
        except np.linalg.LinAlgError:
            return
        if not np.isfinite(solved).all():
            return
        self._rates[self._terms] = np.maximum(solved, 0.0)  # a negative rate would reward work
        self.solved = self.observations


def attention_pairs(start: int, tokens: int) -> float:
    """The (token, earlier or same token) pairs of computing `tokens` prompt tokens after `start` cached:
    each attends to every token before it and itself."""
    return tokens * (start + (tokens + 1) / 2)
