"""Warming a program's next turn while its tool runs (programs.warm_up; the proxy's and the simulator's rule).

When a program's turn is answered, the router foresees where its next turn will go: the instance its policy
would choose now for the turn's prompt (the next turn's prefix), by its scores alone. The next turn will lack
that prefix there when
- it moves: the instance foreseen is not the one that answered, and holds less of the prompt; or
- its KV is evicted where it is: the working sets alive at the answering instance pass its KV cache, so that
  the KV of programs in a tool call there goes before their next turns come. It then moves to the instance
  with the most room for it.
The prompt is then prefilled there (one token) while the tool runs, if the Mooncake pool holds it (the
instance loads it rather than computes it: computing an agent's context again took the time of the turns
running there, and lost more than it won in the simulated programs trace), that instance is idle (no
prefill queued, nothing waiting in its engine) and the program's working set fits beside those there. The
program's working set is counted there from then on (Programs.moved).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from router.metrics import RouterMetrics
from router.programs.table import NoPrograms, Programs
from scorers.candidate import Candidate
from scorers.program_room import kv_in_use
from scorers.request import RoutingRequest

Reason = Literal["moves", "evicted"]


class WarmUp(NamedTuple):
    instance: Candidate
    reason: Reason
    uncached_tokens: int  # of the prompt, those neither the instance nor the pool holds: counted queued there


class WarmUps:
    def __init__(self, enabled: bool, programs: Programs | NoPrograms, metrics: RouterMetrics) -> None:
        self.programs = programs if isinstance(programs, Programs) else None
        self.enabled = enabled and self.programs is not None
        self._metrics = metrics

    def where(
        self,
        prompt: RoutingRequest,
        answered_at: str,
        foreseen: Candidate,
        candidates: Sequence[Candidate],
    ) -> WarmUp | None:
        """Where to warm the next turn of the program whose turn (prompt, as the index holds it now) was
        answered at answered_at, foreseen going to foreseen among candidates; None: nowhere."""
        programs = self.programs
        key = prompt.session_key
        if not self.enabled or programs is None or key is None or not prompt.chain:
            return None
        if not programs.alive(key):  # not in its tool call: paused, or another of its turns runs
            return None
        reason: Reason
        if foreseen.name != answered_at:
            if _held(prompt, foreseen.name) >= _held(prompt, answered_at):
                return None
            target, reason = foreseen, "moves"
        else:
            sets, capacity = programs.at(answered_at), foreseen.kv_capacity_tokens
            if sets is None or not capacity or sets.tokens <= capacity:
                return None
            others = [c for c in candidates if c.name != answered_at]
            if not others:
                return None
            target, reason = max(others, key=_room), "evicted"
        if not _idle(target) or not _fits(target, prompt.prompt_tokens):
            return None
        enough = _enough(prompt)
        if _held(prompt, target.name) >= enough:
            return None  # it holds the prefix already
        loadable = _loadable(prompt, target.name)
        if loadable < enough:
            return None  # computing it again would take the instance's time the turns running there need
        tokens = prompt.prompt_tokens
        return WarmUp(target, reason, tokens - min(loadable * prompt.block_size, tokens))

    def sent(self, session_key: str, warm_up: WarmUp) -> None:
        """The warm-up went: the program's working set is counted where it went."""
        name = warm_up.instance.name
        self._metrics.program_warm_ups(name, warm_up.reason).inc()
        if self.programs is not None:
            self.programs.moved(session_key, name)


def _held(prompt: RoutingRequest, name: str) -> int:
    match = prompt.matches.get(name)
    return 0 if match is None else match.gpu + match.cpu


def _loadable(prompt: RoutingRequest, name: str) -> int:
    match = prompt.matches.get(name)
    return 0 if match is None else match.gpu + match.cpu + match.pool


def _enough(prompt: RoutingRequest) -> int:
    """The prompt's blocks the next turn reuses, but for the last (where the chat's rendering may differ)."""
    return max(max(prompt.prompt_tokens - 1, 0) // prompt.block_size - 1, 1)


def _room(candidate: Candidate) -> int:
    return (candidate.kv_capacity_tokens or 0) - kv_in_use(candidate)


def _idle(candidate: Candidate) -> bool:
    load = candidate.load
    return not candidate.pending_prefill_tokens and (load is None or not load.waiting)


def _fits(candidate: Candidate, tokens: int) -> bool:
    capacity = candidate.kv_capacity_tokens
    return capacity is None or kv_in_use(candidate) + tokens <= capacity
