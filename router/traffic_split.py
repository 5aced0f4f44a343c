"""Which policy serves a request: a header may force one; otherwise the traffic split decides, by weight,
the same way for every request of a session while the split stays as it is.

A session's key hashes to a point in [0, 1); the policies own consecutive ranges of it in the split's order,
as wide as their weights. Changing 90/10 to 50/50 moves only the sessions between 0.5 and 0.9, and a policy
whose weight drops to 0 keeps none. Requests without a session key draw a fresh point each time.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Mapping

import xxhash

_SPAN = float(1 << 64)


class TrafficSplit:
    def __init__(self, weights: Mapping[str, float], rng: random.Random | None = None) -> None:
        """weights: policy name -> weight (>= 0, not all 0), in the order their ranges are laid out."""
        live = {name: float(w) for name, w in weights.items()}
        if not all(0 <= weight < math.inf for weight in live.values()):  # nan fails both comparisons
            raise ValueError("weights must be finite numbers >= 0")
        total = sum(live.values())
        if total == math.inf:
            raise ValueError("the weights add up to more than a float holds; use smaller ones")
        if total <= 0:
            raise ValueError("at least one policy needs a weight above 0")
        self.weights = live
        self._names = [name for name, weight in live.items() if weight > 0]
        self._bounds = list(itertools.accumulate(live[name] / total for name in self._names))
        self._bounds[-1] = 1.0  # rounding must not leave a sliver no policy owns
        self._rng = rng or random.Random()

    def policy_for(self, session_key: str | None) -> str:
        if session_key is None:
            point = self._rng.random()
        else:
            point = xxhash.xxh3_64_intdigest(session_key.encode()) / _SPAN
        return self._names[min(bisect.bisect_right(self._bounds, point), len(self._names) - 1)]

    def shares(self) -> dict[str, float]:
        """Each policy's share of traffic, 0 to 1."""
        total = sum(self.weights.values())
        return {name: weight / total for name, weight in self.weights.items()}
