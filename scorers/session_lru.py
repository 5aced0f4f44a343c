"""Sessions' last placements, the least recently put forgotten first: the one map behind session affinity
(scorers/session_affinity.py) and behind the router's count of the turns that moved
(router/dispatch/decide/session_placements.py)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class SessionLRU(Generic[V]):
    """At most max_sessions entries, session key -> V; put() makes a session the most recent, get() not."""

    def __init__(self, max_sessions: int) -> None:
        self._max_sessions = max_sessions
        self._entries: OrderedDict[str, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, session_key: str, value: V) -> V | None:
        """Remember value for the session, the most recent now; the session's value before, None for a session
        new or forgotten. Past max_sessions the least recently put is forgotten."""
        previous = self._entries.pop(session_key, None)
        self._entries[session_key] = value
        if len(self._entries) > self._max_sessions:
            self._entries.popitem(last=False)
        return previous

    def get(self, session_key: str) -> V | None:
        return self._entries.get(session_key)

    def forget(self, session_key: str) -> None:
        self._entries.pop(session_key, None)
