"""The router's queue for one model: requests wait here holding no instance, and leave in a chosen order.

Bands first: a request leaves only when no request of a higher priority may. Within a band each request is
tagged on arrival, and the smallest tag leaves first:

    tag = max(arrival + cost / aging_tokens_per_s, its flow's share clock)
    share clock = max(arrival, band clock, share clock) + cost / flow_share_tokens_per_s   (after it)

The cost is what ordering weighs:
- `spt`: its predicted uncached tokens. Requests that came together leave shortest first, which lowers the
  median; a prompt N tokens longer waits at most N / aging_tokens_per_s seconds more than a later short
  one, so none starves.
- `fcfs`: every request counts as 1,000 tokens: first come first served.
- `edf`: no cost and no fairness; the earliest deadline (arrival plus its objective's queue limit) first.

The share clock is fairness between flows (tenants, sessions, agent programs): a flow that keeps more than
flow_share_tokens_per_s waiting runs its clock ahead of time and falls behind the flows that do not; two
flows that both do take turns by tokens (by requests under fcfs), whatever their arrival rates. The band
clock (the largest tag let go) keeps a flow that starts late from jumping ahead of those already waiting.

It only orders: when a request may leave is router/dispatch/wait/saturation.py's; limits are
router/dispatch/wait/flow_control.py's.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
Ordering = Literal["spt", "fcfs", "edf"]

# Flows' share clocks are kept while they are ahead of time; past this many, those behind it (as good as a
# flow never seen) are forgotten.
_FLOWS_KEPT = 4096
_FCFS_COST = 1_000.0  # tokens: what every request counts as under fcfs


@dataclass(eq=False, slots=True)
class Queued(Generic[T]):
    item: T
    flow: str
    objective: str
    priority: int
    work: float  # predicted uncached tokens
    since: float
    deadline: float  # past it the request is refused, not dispatched
    model: str = ""
    seq: int = 0
    tag: float = 0.0
    live: bool = True
    tokens: int = 0  # its prompt's, the context it will hold where it is placed


@dataclass(eq=False, slots=True)
class _Band(Generic[T]):
    tagged: list[tuple[float, int, Queued[T]]] = field(default_factory=list)  # a heap by tag
    shares: dict[str, float] = field(default_factory=dict)  # each flow's share clock
    clock: float = 0.0  # virtual: the largest tag let go so far
    count: int = 0

    def live(self) -> Iterator[Queued[T]]:
        """The live requests by tag; the dead ones on top are dropped on the way."""
        heap = self.tagged
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        if not heap:
            return
        yield heap[0][2]
        # Past the top (rare: its flow was blocked), the rest in order, from a copy.
        for _, _, queued in sorted(heap[1:]):
            if queued.live:
                yield queued


class FlowQueue(Generic[T]):
    def __init__(
        self,
        ordering: Ordering = "spt",
        aging_tokens_per_s: float = 100_000.0,
        flow_share_tokens_per_s: float = 10_000.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ordering, self._clock = ordering, clock
        self.aging_tokens_per_s, self.flow_share_tokens_per_s = aging_tokens_per_s, flow_share_tokens_per_s
        self._bands: dict[int, _Band[T]] = {}
        self._priorities: list[int] = []  # highest first
        self._seq = itertools.count()
        self._length = 0
        self.by_objective: dict[str, int] = {}
        self.by_flow: dict[str, int] = {}

    def __len__(self) -> int:
        return self._length

    def add(self, queued: Queued[T]) -> None:
        queued.seq = next(self._seq)
        band = self._bands.get(queued.priority)
        if band is None:
            band = self._bands[queued.priority] = _Band()
            self._priorities = sorted(self._bands, reverse=True)
        heapq.heappush(band.tagged, (self._tag(band, queued), queued.seq, queued))
        band.count += 1
        self._length += 1
        self.by_objective[queued.objective] = self.by_objective.get(queued.objective, 0) + 1
        self.by_flow[queued.flow] = self.by_flow.get(queued.flow, 0) + 1

    def remove(self, queued: Queued[T]) -> None:
        """queued leaves (sent, refused, or its client left)."""
        if not queued.live:
            return
        queued.live = False
        self._length -= 1
        _lower(self.by_objective, queued.objective)
        _lower(self.by_flow, queued.flow)
        band = self._bands[queued.priority]
        band.count -= 1
        if band.count == 0:
            del self._bands[queued.priority]
            self._priorities.remove(queued.priority)

    def heads(self, blocked: Callable[[str], bool] = lambda flow: False) -> Iterator[Queued[T]]:
        """The requests in the order they should leave, the highest band's first, skipping blocked flows
        (at their in-flight limit). Meant to be read only as far as the first that may go."""
        for priority in list(self._priorities):
            band = self._bands.get(priority)
            if band is None:
                continue
            for queued in band.live():
                if not blocked(queued.flow):
                    yield queued

    def expired(self) -> list[Queued[T]]:
        """The requests waiting past their deadline."""
        now = self._clock()
        return [
            queued
            for band in self._bands.values()
            for _, _, queued in band.tagged
            if queued.live and queued.deadline <= now
        ]

    def dispatched(self, queued: Queued[T]) -> None:
        """queued leaves to be sent: the band's virtual clock moves up to its tag."""
        band = self._bands[queued.priority]
        band.clock = max(band.clock, queued.tag)
        self.remove(queued)

    def _tag(self, band: _Band[T], queued: Queued[T]) -> float:
        if self.ordering == "edf":
            return queued.deadline
        arrival = queued.since
        cost = _FCFS_COST if self.ordering == "fcfs" else queued.work + 1.0
        # A flow's clock starts from the band's (no credit for having been idle, as in start-time fair
        # queueing) and runs at most one queue limit ahead (what it was charged for requests that timed out
        # or whose clients left is not held against it for longer).
        floor = max(arrival, band.clock)
        share = min(band.shares.get(queued.flow, 0.0), floor + queued.deadline - arrival)
        band.shares[queued.flow] = max(floor, share) + cost / self.flow_share_tokens_per_s
        queued.tag = max(arrival + cost / self.aging_tokens_per_s, share)
        if len(band.shares) > _FLOWS_KEPT:  # a flow whose clock has passed starts afresh anyway
            band.shares = {flow: kept for flow, kept in band.shares.items() if kept > floor}
        return queued.tag


def _lower(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
