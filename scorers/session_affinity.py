"""Session affinity: the instance a session was last sent to scores 1, every other 0.

The policy reports each choice through observe(). Sessions are kept for ttl_s after their last request,
at most max_sessions of them, the least recently used dropped first. No session key: all score 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pydantic import Field

from scorers._scores import named
from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import RoutingRequest
from scorers.session_lru import SessionLRU


class SessionAffinityParams(Params):
    max_sessions: int = Field(default=100_000, gt=0, description="sessions remembered; LRU dropped first")
    ttl_s: float = Field(default=600.0, gt=0, description="affinity lasts this long after the last request")


class SessionAffinityScorer:
    def __init__(self, params: SessionAffinityParams, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s, self._clock = params.ttl_s, clock
        self._sessions = SessionLRU[tuple[str, float]](params.max_sessions)  # key -> (instance, last sent)

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        instance = self.instance_of(request.session_key)
        return named(candidates, instance)

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None:
        key = request.session_key
        if key is None:
            return
        self._sessions.put(key, (chosen.name, self._clock()))

    def placed_elsewhere(self, session_key: str, instance: str) -> None:
        """Another replica sent the session's turn to instance: its next one here follows it."""
        self._sessions.put(session_key, (instance, self._clock()))

    def instance_of(self, session_key: str | None) -> str | None:
        """The instance this session was last sent to, unless that has expired."""
        if session_key is None:
            return None
        entry = self._sessions.get(session_key)
        if entry is None:
            return None
        instance, sent_at = entry
        if self._clock() - sent_at > self._ttl_s:
            self._sessions.forget(session_key)
            return None
        return instance

    def __len__(self) -> int:
        return len(self._sessions)


REGISTRATION: Registration[Scorer] = Registration(SessionAffinityParams, SessionAffinityScorer, clocked=True)
