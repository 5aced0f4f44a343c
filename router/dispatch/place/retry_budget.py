"""How many sent requests may be sent again elsewhere: a share of the traffic, so that a failing fleet is not
hit with a storm of repeats."""

from __future__ import annotations


class RetryBudget:
    """Retries of sent requests stay a fraction of the traffic: each request earns `ratio` of a retry (up to
    `burst` saved), each retry spends one, so a failing fleet is not hit with a storm of repeats."""

    def __init__(self, ratio: float = 0.2, burst: float = 10.0) -> None:
        self._ratio, self._burst, self._tokens = ratio, burst, burst

    def earn(self) -> None:
        self._tokens = min(self._burst, self._tokens + self._ratio)

    def spend(self) -> bool:
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
