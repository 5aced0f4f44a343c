"""Agent programs across router replicas: each tells its peers the turns it starts and ends.

A program's turns reach whichever replica the load balancer picks. So each replica follows every program of
the fleet: the turns it routes itself, and those its peers tell in their snapshots
(router/upstreams/peer_sync.py), heard one snapshot interval later. A turn through another replica is then
the program's next turn, not a new program placed anew, and each instance's working sets count every
replica's programs. A peer's turns in flight are held by peer: one that goes silent has them ended, so a
replica that dies leaves no program counted as running.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from router.programs.table import Programs
from router.upstreams.peer_sync import ProgramTurn

MAX_TOLD = 4096  # turns told in one snapshot; past it the oldest go untold
MAX_RUNNING_PER_PEER = 65_536  # programs' turns a peer is held to have in flight; past it, not followed


class ProgramTurnsShared:
    """The programs' side of the snapshots (PeerSync's SharedPrograms)."""

    def __init__(self, programs: Programs) -> None:
        self._programs = programs
        self._told: deque[ProgramTurn] = deque(maxlen=MAX_TOLD)
        self._running: dict[str, Counter[str]] = {}  # peer -> program key -> its turns there not ended
        programs.on_turn = self._turn

    def _turn(self, key: str, instance: str, tokens: int) -> None:
        self._told.append(ProgramTurn(key, instance, tokens))

    def shared(self) -> list[ProgramTurn]:
        """The turns this router started and ended since the last call."""
        told = list(self._told)
        self._told.clear()
        return told

    def heard(self, peer: str, turns: Sequence[ProgramTurn]) -> None:
        running = self._running.setdefault(peer, Counter())
        programs = self._programs
        for turn in turns:
            if turn.instance:
                if turn.key not in running and len(running) >= MAX_RUNNING_PER_PEER:
                    continue
                running[turn.key] += 1
                programs.started_elsewhere(turn.key, turn.instance, turn.tokens)
            elif running.get(turn.key):  # a turn whose start was heard
                running[turn.key] -= 1
                if not running[turn.key]:
                    del running[turn.key]
                programs.ended_elsewhere(turn.key)

    def forget(self, peer: str) -> None:
        """A peer gone silent: its turns in flight end."""
        for key, turns in self._running.pop(peer, Counter()).items():
            self._programs.ended_elsewhere(key, turns)
