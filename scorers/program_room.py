"""Program room: a new agent program starts where the KV working sets alive leave the most room.

An agent program's later turns stay where its context is cached (session affinity), so where its first turn
goes decides where it grows. An instance's KV cache holds the contexts of the programs running there and of
those in a tool call, which come back for them (their working sets, router/programs/). A new program placed
where those already fill the cache evicts what a program in a tool call comes back for, and that program
computes it again. For a request that starts a program (RoutingRequest.new_program: a program new, or back
after a tool call that outlasted the time-to-live, whose working set lapsed, or one no larger than the mean of
those at an instance whose working sets outgrew its cache, which it is better to leave once than to share)
each candidate scores the KV its working sets (or its contexts in flight, when more) leave free, as a share
of `room` (half its cache):
1 with that much free or more, so that where every instance has room the other scorers decide (a new session
still goes where the agents' shared instructions are cached), less as the cache fills, 0 when full; a
candidate whose capacity is not known yet scores 0. Any other request scores 0 everywhere: the scorer decides
nothing for it.

Room alone does not see that programs grow. Agent sessions often start within seconds of each other, while
their working sets are small and every instance has room; the TTFT cost then sends each new session where the
shared instructions are cached, and a few instances take every session. Tens of turns later their contexts
outgrow those instances' caches and evict one another, while other instances sit idle
(docs/notes/simulate-investigations.md, "New sessions without the pool"). So a candidate where the prompt's
prefix is cached, and that would then hold more than `over_even_share` programs above its even share of
those alive (by KV capacity), scores 0 too: sessions group where the instructions are cached only while they
stay spread. Computing the instructions once more on another instance costs one prefill of them, once. Only
while most programs come back for another turn (RoutingRequest.programs_come_back): a session key on one-shot
questions (a RAG user) names a program that never grows, and those go where their documents are cached.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import Field

from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.plugins import Scorer
from scorers.request import NO_MATCH, RoutingRequest


class ProgramRoomParams(Params):
    room: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="the share of an instance's KV cache left free that is room enough: an instance with as "
        "much scores 1, one with less the share of it it has",
    )
    over_even_share: int | None = Field(
        default=1,
        ge=0,
        description="while most programs come back for another turn, a new program scores 0 at an instance "
        "where its prefix is cached that would then hold more than this many programs alive above its even "
        "share of them (by KV capacity); null: by room alone",
    )


class ProgramRoomScorer:
    def __init__(self, params: ProgramRoomParams) -> None:
        self._room, self._over_even_share = params.room, params.over_even_share

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        if not request.new_program:
            return [0.0] * len(candidates)
        scores = [self._score(c) for c in candidates]
        if self._over_even_share is not None and request.programs_come_back:
            for n, most in enumerate(most_programs(candidates, self._over_even_share)):
                if candidates[n].programs_alive >= most and _cached_at(request, candidates[n]):
                    scores[n] = 0.0
        return scores

    def _score(self, candidate: Candidate) -> float:
        capacity = candidate.kv_capacity_tokens
        if not capacity:
            return 0.0
        free = capacity - kv_in_use(candidate)
        return min(max(free / (self._room * capacity), 0.0), 1.0)


def most_programs(candidates: Sequence[Candidate], over: int) -> list[int]:
    """For each candidate, the most programs it may hold, a new one included: `over` above its even share
    of them all, shares by KV capacity (equal while any is not known)."""
    programs = sum(c.programs_alive for c in candidates) + 1
    capacities = [c.kv_capacity_tokens or 0 for c in candidates]
    total = sum(capacities)
    if not all(capacities):
        capacities, total = [1] * len(candidates), len(candidates)
    return [math.ceil(programs * capacity / total) + over for capacity in capacities]


def _cached_at(request: RoutingRequest, candidate: Candidate) -> bool:
    match = request.matches.get(candidate.name, NO_MATCH)
    return match.gpu + match.cpu > 0


def kv_in_use(candidate: Candidate) -> int:
    """The KV tokens taken at candidate: the programs' working sets there, or the contexts in flight when
    more (requests of no program)."""
    return max(candidate.program_tokens, candidate.active_tokens)


REGISTRATION: Registration[Scorer] = Registration(ProgramRoomParams, ProgramRoomScorer)
