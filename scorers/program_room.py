"""Program room: a new agent program starts where the KV working sets alive leave the most room.

An agent program's later turns stay where its context is cached (session affinity), so where its first turn
goes decides where it grows. An instance's KV cache holds the contexts of the programs running there and of
those in a tool call, which come back for them (their working sets, router/programs/). A new program placed
where those already fill the cache evicts what a program in a tool call comes back for, and that program
computes it again. For a request that starts a program (RoutingRequest.new_program: a program new, or back
after a tool call that outlasted the time-to-live, whose working set lapsed) each candidate scores the KV its
working sets (or its contexts in flight, when more) leave free, as a share of `room` (half its cache):
1 with that much free or more, so that where every instance has room the other scorers decide (a new session
still goes where the agents' shared instructions are cached), less as the cache fills, 0 when full; a
candidate whose capacity is not known yet scores 0. Any other request scores 0 everywhere: the scorer decides
nothing for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import RoutingRequest


class ProgramRoomParams(Params):
    room: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="the share of an instance's KV cache left free that is room enough: an instance with as "
        "much scores 1, one with less the share of it it has",
    )


class ProgramRoomScorer:
    def __init__(self, params: ProgramRoomParams) -> None:
        self._room = params.room

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        if not request.new_program:
            return [0.0] * len(candidates)
        return [self._score(c) for c in candidates]

    def _score(self, candidate: Candidate) -> float:
        capacity = candidate.kv_capacity_tokens
        if not capacity:
            return 0.0
        free = capacity - kv_in_use(candidate)
        return min(max(free / (self._room * capacity), 0.0), 1.0)


def kv_in_use(candidate: Candidate) -> int:
    """The KV tokens taken at candidate: the programs' working sets there, or the contexts in flight when
    more (requests of no program)."""
    return max(candidate.program_tokens, candidate.active_tokens)


REGISTRATION: Registration[Scorer] = Registration(ProgramRoomParams, ProgramRoomScorer)
