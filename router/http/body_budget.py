"""The memory request bodies may take before their requests are admitted, all requests together.

A body is read before its request takes an admission slot (a client that trickles its body must not hold
one), so without a bound the bodies being read grow with the connections, not with the work admitted: sixty
clients each sending a 30 MiB body less one byte held 1.8 GB. Each body is granted its share of the budget
before it is read (its Content-Length; a body without one, the largest a body may be), and gives it back once
its request is admitted or ends. A body that must wait is not read: the server stops reading its connection,
so what waits costs a socket's buffers, not the body.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable


class BodyBudget:
    def __init__(self, capacity: Callable[[], int]) -> None:
        """capacity: read at each grant, so that a reload applies."""
        self._capacity = capacity
        self._taken = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def taken(self) -> int:
        return self._taken

    async def take(self, share: int) -> int:
        """Wait until share bytes are free, in the order asked, and take them; a share larger than the whole
        budget takes all of it. Returns what was taken, for give_back."""
        share = min(share, self._capacity())
        if not self._waiting and self._taken + share <= self._capacity():
            self._taken += share
            return share
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append((share, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.cancelled():  # still waiting: its place goes (_grant skips it if it comes first)
                with contextlib.suppress(ValueError):
                    self._waiting.remove((share, granted))
                self._grant()  # what waited behind it may fit now
            else:  # granted as it was cancelled: not wanted now
                self.give_back(share)
            raise
        return share

    def give_back(self, share: int) -> None:
        self._taken -= share
        self._grant()

    def _grant(self) -> None:
        capacity = self._capacity()
        # Nothing taken: the first in line goes whatever its share, which a reload may have made too large.
        while self._waiting and (not self._taken or self._taken + self._waiting[0][0] <= capacity):
            share, granted = self._waiting.popleft()
            if not granted.done():
                self._taken += share
                granted.set_result(None)
