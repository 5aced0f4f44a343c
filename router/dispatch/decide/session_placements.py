"""Where each session's last turn went, to count the turns that moved: a moved turn finds its context in no
instance's cache but by chance (or in the pool), so the share that move is how well routing keeps sessions in
place. Sessions are known by the router's digest of their key; the least recently seen are forgotten first."""

from __future__ import annotations

from typing import Literal

from scorers.session_lru import SessionLRU

Placement = Literal["first", "same", "moved"]


class SessionPlacements:
    def __init__(self, max_sessions: int = 65_536) -> None:
        self._last = SessionLRU[str](max_sessions)  # session key -> instance of its last turn

    def __len__(self) -> int:
        return len(self._last)

    def record(self, session_key: str, instance: str) -> Placement:
        """Where this turn went against the session's last one; first for a session new or forgotten."""
        last = self._last.put(session_key, instance)
        if last is None:
            return "first"
        return "same" if last == instance else "moved"
