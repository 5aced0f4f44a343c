"""A count that decays with a half-life: recent events, weighted by how recent (placements, arrivals)."""

from __future__ import annotations

import math


class DecayingCount:
    def __init__(self, half_life_s: float, now: float) -> None:
        self._half_life_s = half_life_s
        self._count, self._at = 0.0, now

    def at(self, now: float) -> float:
        """The count at `now`: each event weighs half as much every half_life_s."""
        return float(self._count * 0.5 ** (max(now - self._at, 0.0) / self._half_life_s))

    def add(self, now: float) -> None:
        self._count, self._at = self.at(now) + 1.0, now

    def rate_per_s(self, now: float) -> float:
        """Events a second: the count over what a steady rate of 1 settles at (half_life / ln 2)."""
        return self.at(now) * math.log(2) / self._half_life_s
