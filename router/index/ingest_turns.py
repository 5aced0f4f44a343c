"""The engines' KV events take a bounded slice of each turn of the event loop, however many instances send.

asyncio runs every ready task once a turn. When each instance's subscriber took a run of up to 256 batches
(about 4 ms of 32-block batches) whenever it had them, a burst from 8 engines held every await of a request
for 8 runs: a 1 ms request through `kvroute serve` took up to 220 ms during a 2M-block burst. The subscribers
of one router share these turns instead: a subscriber takes its run only while this turn's ingest has time
left (SLICE_S), else it waits for a later turn, first come first served, as many let in a turn as its slice
holds of runs as long as the recent ones (one a turn when each fills a slice; dozens when a fleet of thousands
sends a message each, which one a turn slowed five times), sharing the slice rather than taking one each. A
request then waits about a slice at each of its awaits, and a burst still gets the turns nothing else wants.
A fifth of a millisecond rather than half: during a 2M-block burst a chat's time added by the router fell
from a p50 of 3.3-4.1 ms to 2.1 (scripts/measure_requests_during_burst.py), with no ingest lost, from 8
instances or from 2,000 (kvroute bench index, the whole serve's CPU). While the router has requests in
progress, and for BUSY_HOLD_S after, a turn's slice is a tenth of that (BUSY_SLICE_S): requests first.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

SLICE_S = 0.0002
# While the router has requests in progress. At 0.2 ms a turn, ingest's slices at a chat's every await were
# most of what the router added to it during a 2M-block burst: p50 1.6-1.7, p99 3.4-5.1 ms, against 0.7-0.8
# and 2.6-3.8 ms at a fiftieth of a millisecond (scripts/measure_requests_during_burst.py --router-cpu 0
# --publishers-nice 19 --engine-first). Short turns cost ingest ~30% more CPU a block (the whole serve in
# kvroute bench index: 1.34 M blocks a CPU-second against 1.9), and the burst took 2.0 s against 1.5.
BUSY_SLICE_S = 0.00002
# And for this long after: the next request's first steps, before it is admitted, come in short turns too.
BUSY_HOLD_S = 0.05
_RECENT = 0.1  # the weight of a run in the recent runs' mean length


def _never() -> bool:
    return False


class IngestTurns:
    def __init__(
        self,
        slice_s: float = SLICE_S,
        busy_slice_s: float = BUSY_SLICE_S,
        busy: Callable[[], bool] = _never,
        busy_hold_s: float = BUSY_HOLD_S,
    ) -> None:
        """busy: whether the router has requests in progress; each turn's slice is busy_slice_s while it
        has and for busy_hold_s after, slice_s otherwise."""
        self.slice_s = self._idle_slice_s = slice_s
        self._busy_slice_s, self._busy, self._busy_hold_s = busy_slice_s, busy, busy_hold_s
        self._busy_until = 0.0  # time.perf_counter() until which turns keep the busy slice
        self._spent = 0.0  # of this turn's slice, as the gate counts it (runs let in take it all)
        self._used = 0.0  # of this turn's slice, by the runs that went in it
        self._run_s = slice_s  # the recent runs' mean length
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

    def run_ends(self, started: float) -> float:
        """When a run that began at started (time.perf_counter()) stops taking batches: where this turn's
        slice runs out. The runs let into one turn share it, rather than taking a slice each (eight runs
        let in at a burst's start, while the recent runs were a message long, made a turn of eight slices)."""
        return started + max(self.slice_s - self._used, 0.0)

    def spent(self, started: float) -> None:
        """Ingest that began at started (time.perf_counter()) is done for this turn."""
        run_s = time.perf_counter() - started
        self._spent += run_s
        self._used += run_s
        self._run_s += _RECENT * (run_s - self._run_s)
        self._due()

    def _due(self) -> None:
        if not self._next_turn_due:
            self._next_turn_due = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """Scheduled during a turn, this runs in the next one: its slice starts afresh, for the waiters whose
        runs it holds (at least one)."""
        self._next_turn_due = False
        self._spent = self._used = 0.0
        now = time.perf_counter()
        if self._busy():
            self._busy_until = now + self._busy_hold_s
        self.slice_s = self._busy_slice_s if now < self._busy_until else self._idle_slice_s
        let_in = max(1, int(self.slice_s / max(self._run_s, 1e-6)))
        while self._waiting and let_in:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                let_in -= 1
        if self._waiting or let_in == 0:
            self._spent = self.slice_s  # the runs let in are this turn's
            self._due()
