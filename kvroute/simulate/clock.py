"""The discrete-event loop: callbacks at simulated times, in time order (ties in scheduling order)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time_s: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(time_s, self.now), next(self._order), callback))

    def run(self) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap:
            self.now, _, callback = pop(heap)
            callback()

    def clock(self) -> float:
        return self.now
