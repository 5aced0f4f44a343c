"""The engines' KV events take a bounded slice of each turn of the event loop, however many instances send.

asyncio runs every ready task once a turn. When each instance's subscriber took a run of up to 256 batches
(about 4 ms of 32-block batches) whenever it had them, a burst from 8 engines held every await of a request
for 8 runs: a 1 ms request through `kvroute serve` took up to 220 ms during a 2M-block burst. The subscribers
of one router share these turns instead: a subscriber takes its run only while this turn's ingest has time
left (SLICE_S), else it waits for a later turn, the waiters let in one a turn, first come first served. A
request then waits about a slice at each of its awaits, and a burst still gets the turns nothing else wants.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

SLICE_S = 0.0005


class IngestTurns:
    def __init__(self, slice_s: float = SLICE_S) -> None:
        self.slice_s = slice_s
        self._spent = 0.0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._next_turn_due = False

    async def take(self) -> None:
        """Returns once the event loop's current turn has ingest time left for the caller."""
        if self._spent < self.slice_s and not self._waiting:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._due()
        await waiter  # cancelled: the next turn passes over it

    def spent(self, started: float) -> None:
        """Ingest that began at started (time.perf_counter()) is done for this turn."""
        self._spent += time.perf_counter() - started
        self._due()

    def _due(self) -> None:
        if not self._next_turn_due:
            self._next_turn_due = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """Scheduled during a turn, this runs in the next one: its slice starts afresh, with one waiter."""
        self._next_turn_due = False
        self._spent = 0.0
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._spent = self.slice_s  # that one's run is this turn's
                self._due()
                return
