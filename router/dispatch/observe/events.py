"""Events a stage tells without knowing who listens: an outcome says room was freed, and the waiting stage,
subscribed, lets requests go. Nothing below calls a stage above it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


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


class Topic(Generic[T]):
    """Something that happens to a thing (a decision served, one withdrawn), told with it to each subscriber
    in the order they subscribed."""

    __slots__ = ("_subscribers",)

    def __init__(self) -> None:
        self._subscribers: list[Callable[[T], None]] = []

    def subscribe(self, subscriber: Callable[[T], None]) -> None:
        self._subscribers.append(subscriber)

    def tell(self, thing: T) -> None:
        for subscriber in self._subscribers:
            subscriber(thing)
