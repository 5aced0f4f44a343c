"""The discrete-event loop: callbacks at simulated times, in time order (ties in scheduling order).

Callbacks due now (soon()) run before any timed one, in the order they came, as asyncio runs its ready
callbacks before the timers that fall due: what a router's coroutine does in answer to an event
(kvroute/simulate/trace_loop.py) is done before the next event, as a router answers at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._ready: deque[Callable[[], None]] = deque()

    def at(self, time_s: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(time_s, self.now), next(self._order), callback))

    def soon(self, callback: Callable[[], None]) -> None:
        """callback now, before any callback due at a time."""
        self._ready.append(callback)

    def drain(self) -> None:
        """Run the callbacks due now, and those they make due now, before returning."""
        ready = self._ready
        while ready:
            ready.popleft()()

    def run(self) -> None:
        heap, pop, ready = self._heap, heapq.heappop, self._ready
        while heap or ready:
            if ready:
                ready.popleft()()
                continue
            self.now, _, callback = pop(heap)
            callback()

    def clock(self) -> float:
        return self.now
