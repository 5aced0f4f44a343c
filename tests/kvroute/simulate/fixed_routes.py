"""A simulated router that sends each request to the next of the instances it is given, in order."""

from __future__ import annotations

from kvroute.simulate.policies import SimPolicy


class Fixed(SimPolicy):
    name = "fixed"

    def __init__(self, *targets: int) -> None:
        self._targets = list(targets)

    def route(self, request: object) -> int:
        return self._targets.pop(0)
