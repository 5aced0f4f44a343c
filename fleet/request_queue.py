"""An engine's waiting queue in the order vLLM V1's scheduler keeps it (vllm/v1/core/sched/request_queue.py).

`fcfs` (vLLM's default): arrival order, a preempted request back at the head. `priority`
(`--scheduling-policy priority`): the lowest `priority` value first, then the earliest arrival; a preempted
request goes back in that order, as there is no head to put it at. Both simulated engines (fleet/engine.py,
kvroute/simulate/engine.py) wait in one.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, Literal, TypeVar

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")

Item = TypeVar("Item")
Rank = tuple[int, float]  # (priority, arrival): lower first


class FcfsQueue(Generic[Item]):
    """First come, first served."""

    def __init__(self) -> None:
        self._items: deque[Item] = deque()

    def add(self, item: Item) -> None:
        self._items.append(item)

    def prepend(self, item: Item) -> None:
        """A preempted request, to run again before those that came after it."""
        self._items.appendleft(item)

    def peek(self) -> Item:
        return self._items[0]

    def pop(self) -> Item:
        return self._items.popleft()

    def remove(self, item: Item) -> None:
        self._items.remove(item)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(self._items)


class PriorityQueue(Generic[Item]):
    """By rank (priority, then arrival), ties in the order they were added."""

    def __init__(self, rank: Callable[[Item], Rank]) -> None:
        self._rank = rank
        self._heap: list[tuple[Rank, int, Item]] = []
        self._order = itertools.count()

    def add(self, item: Item) -> None:
        heapq.heappush(self._heap, (self._rank(item), next(self._order), item))

    def prepend(self, item: Item) -> None:
        self.add(item)

    def peek(self) -> Item:
        return self._heap[0][2]

    def pop(self) -> Item:
        return heapq.heappop(self._heap)[2]

    def remove(self, item: Item) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not item]
        heapq.heapify(self._heap)

    def __contains__(self, item: object) -> bool:
        return any(entry[2] is item for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Item]:
        return (entry[2] for entry in sorted(self._heap))


RequestQueue = FcfsQueue[Item] | PriorityQueue[Item]


def request_queue(policy: SchedulingPolicy, rank: Callable[[Item], Rank]) -> RequestQueue[Item]:
    """The waiting queue of an engine scheduling by policy; rank: a request's (priority, arrival)."""
    return PriorityQueue(rank) if policy == "priority" else FcfsQueue()


def preemption_victim(running: list[Item], policy: SchedulingPolicy, rank: Callable[[Item], Rank]) -> Item:
    """Whom the engine preempts when blocks run out: the last admitted, or by priority the lowest-ranked
    (the highest priority value, then the latest arrival)."""
    return max(running, key=rank) if policy == "priority" else running[-1]
