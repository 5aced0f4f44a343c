"""Admission control: at most max_in_flight requests in the router, a bounded queue behind them, and a 429
with Retry-After for what does not fit, so overload turns into quick refusals instead of slow timeouts.

A request holds its slot until its answer is relayed to the end (a stream's slot is freed when the stream is).
"""

from __future__ import annotations

import asyncio


class Overloaded(Exception):
    """No slot now and no room to wait (or the wait ran out); the message says which."""


class Admission:
    def __init__(self, max_in_flight: int, queue_size: int, queue_timeout_s: float) -> None:
        self._slots = asyncio.Semaphore(max_in_flight)
        self._queue_size, self._timeout = queue_size, queue_timeout_s
        self.waiting = 0
        self.admitted = 0  # requests holding a slot

    async def enter(self) -> None:
        if not self._slots.locked():
            await self._slots.acquire()
            self.admitted += 1
            return
        if self.waiting >= self._queue_size:
            raise Overloaded("queue_full")
        self.waiting += 1
        try:
            # A waiter cancelled (its client left) leaves the queue; Semaphore.acquire hands on a slot it was
            # given in the same turn.
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire()
            self.admitted += 1
        except TimeoutError:
            raise Overloaded("queue_timeout") from None
        finally:
            self.waiting -= 1

    def leave(self) -> None:
        self.admitted -= 1
        self._slots.release()
