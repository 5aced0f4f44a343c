"""Program room: a new agent program starts where the KV working sets alive leave the most room.

An agent program's later turns stay where its context is cached (session affinity), so where its first turn
goes decides where it grows. An instance's KV cache holds the contexts of the programs running there and of
those in a tool call, which come back for them (their working sets, router/programs/). A new program placed
where those already fill the cache evicts what a program in a tool call comes back for, and that program
computes it again. For a request that starts a program (RoutingRequest.new_program: a program new, or back
after a tool call that outlasted the time-to-live, whose working set lapsed) each candidate scores the
KV tokens its working sets (or its contexts in flight, when more) leave free, against the most any candidate
leaves (1); a candidate whose capacity is not known yet scores 0. Any other request scores 0 everywhere: the
scorer decides nothing for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import RoutingRequest


class ProgramRoomParams(Params):
    pass


class ProgramRoomScorer:
    def __init__(self, params: ProgramRoomParams) -> None:
        pass

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        if not request.new_program:
            return [0.0] * len(candidates)
        free = [
            0
            if not c.kv_capacity_tokens
            else max(c.kv_capacity_tokens - max(c.program_tokens, c.active_tokens), 0)
            for c in candidates
        ]
        most = max(free, default=0)
        return [room / most if most else 0.0 for room in free]


REGISTRATION: Registration[Scorer] = Registration(ProgramRoomParams, ProgramRoomScorer)
