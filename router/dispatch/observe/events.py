"""Events a stage tells without knowing who listens: an outcome says room was freed, and the waiting stage,
subscribed, lets requests go. Nothing below calls a stage above it."""

from __future__ import annotations

from collections.abc import Callable


class Event:
    """Something that happens, told to each subscriber in the order they subscribed."""

    __slots__ = ("_subscribers",)

    def __init__(self) -> None:
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, subscriber: Callable[[], None]) -> None:
        self._subscribers.append(subscriber)

    def fire(self) -> None:
        for subscriber in self._subscribers:
            subscriber()
