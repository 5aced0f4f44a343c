"""Where each session's last turn went, to count the turns that moved: a moved turn finds its context in no
instance's cache but by chance (or in the pool), so the share that move is how well routing keeps sessions in
place. Sessions are known by the router's digest of their key; the least recently seen are forgotten first.

Replicas sharing a store tell each other the placements they made (router/upstreams/peer_sync.py): a
session's next turn through another replica then follows it there, and counts as moved only if it moved."""

from __future__ import annotations

from typing import Literal

from scorers.session_lru import SessionLRU

Placement = Literal["first", "same", "moved"]
TOLD_MAX = 4096  # placements told peers in one snapshot; more are not told


class SessionPlacements:
    def __init__(self, max_sessions: int = 65_536) -> None:
        self._last = SessionLRU[str](max_sessions)  # session key -> instance of its last turn
        self._told: dict[str, str] | None = None  # placed since peers were last told (once they are)

    def __len__(self) -> int:
        return len(self._last)

    def record(self, session_key: str, instance: str) -> Placement:
        """Where this turn went against the session's last one; first for a session new or forgotten."""
        last = self._last.put(session_key, instance)
        told = self._told
        if told is not None and len(told) < TOLD_MAX:
            told[session_key] = instance
        if last is None:
            return "first"
        return "same" if last == instance else "moved"

    def placed_here(self) -> dict[str, str]:
        """The placements made since the last call, for peers: session key -> instance."""
        told, self._told = self._told or {}, {}
        return told

    def placed_elsewhere(self, session_key: str, instance: str) -> None:
        """A peer placed a turn of the session at instance."""
        self._last.put(session_key, instance)
