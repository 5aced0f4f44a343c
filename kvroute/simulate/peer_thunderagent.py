"""Dynamo's KV router under Dynamo's ThunderAgent program scheduler, at its shipped defaults.

The scheduler as the ThunderAgent Scheduler Reference
(https://docs.nvidia.com/dynamo/dev/components/thunder-agent-scheduler) and Program Scheduler guide
(https://docs.nvidia.com/dynamo/dev/agents/thunder-agent-program-scheduler) describe it, its details from
their source, `dynamo.thunderagent_router` (components/src/dynamo/thunderagent_router/router.py and
__main__.py in ai-dynamo/dynamo).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.simulate.engine import SimRequest
from kvroute.simulate.peers import DynamoCost
from kvroute.simulate.view import RouterView
from router.upstreams.settings import UpstreamConfig
from scorers.request import NO_MATCH

# ThunderAgentConfig's defaults, the flags' in the reference's table.
PAUSE_THRESHOLD = 0.95  # working set / retention budget that starts a pause cycle
PAUSE_TARGET = 0.80  # what a pause cycle drives it down to
RESUME_HYSTERESIS = 0.10  # resume only below PAUSE_THRESHOLD - this
RESUME_TIMEOUT_S = 1800.0  # a held turn is let go after this, whatever the room
SCHEDULER_INTERVAL_S = 5.0
ACTING_TOKEN_WEIGHT = 1.0  # an acting program's tokens in the pause-side working set
ACTING_DECAY_TAU_S = 1.0  # and their half-life in the placement-side (decayed) load
BUFFER_PER_PROGRAM = 100  # tokens of headroom counted for every program
PROGRAM_IDLE_TTL_S = 600.0  # a program idle this long after its last answer is released
# Retries of a refused request, as the simulation makes them (kvroute/simulate/run.py ATTEMPTS): after the
# last one the turn has ended, as the source's `finally` ends it.
_ATTEMPTS = UpstreamConfig().attempts


@dataclass(eq=False)
class _Program:
    session: str
    reasoning: bool = True  # a turn of it runs or waits; else acting (between turns: its tool call)
    paused: bool = False
    replica: int | None = None  # the worker it is accounted on and its turns are pinned to
    tokens: int = 0  # token_total: its context as last counted
    steps: int = 0
    marked: bool = False  # to be paused once its turn in flight is answered
    acting_since: float = 0.0
    turn: SimRequest | None = None  # its turn in flight or held
    held: SimRequest | None = None  # its turn waiting in the router while it is paused


@dataclass
class _Usage:
    """One worker's working set, from one pass over the programs, kept in step within a tick."""

    capacity: int
    used: int = 0
    programs: list[_Program] = field(default_factory=list)


class DynamoThunderAgent(DynamoCost):
    """`dynamo.thunderagent_router` in front of Dynamo's KvRouter (DynamoCost), its defaults.

    - A program is a session (X-Dynamo-Session-ID: SimRequest.session); requests without one bypass the
      scheduler and go by DynamoCost. A program is reasoning while a turn of it runs or waits and acting
      (in a tool call) from its answer to its next turn.
    - Working set of a worker: over the active (not paused) programs placed on it, reasoning and acting
      alike, each one's token_total (its prompt at admission, then prompt plus answer so far; acting ones x
      acting_token_weight 1.0) + buffer_per_program 100. Retention budget: the worker's GPU KV capacity
      (kv_capacity_tokens); HiCache host capacity would add to it, Mooncake's never does (the pool, on or
      off, adds nothing).
    - Placement: a new program goes to the worker with room for its prompt + 100 of least decayed load
      (acting tokens halve every acting_decay_tau_s 1 s), and every turn of it is pinned there
      (`backend_instance_id`): DynamoCost books the turn but does not choose. It chooses only for requests
      without a session and a turn of a program left unplaced, which its first token then places. While
      any program is paused, or no worker has room, a new program is paused at once (queued behind them).
    - Every scheduler_interval_seconds (5 s): programs idle for program_idle_ttl_seconds (600 s, the
      source's default) since their last answer are released; then resume, then pause. Pause: on a worker
      above pause_threshold 0.95, acting programs, smallest first, until it is at pause_target 0.80; still
      above, its reasoning programs are marked and paused at their answers (all of them, as the source
      does; the guide says the smallest). A paused program leaves its worker's working set and its next
      turn is held in the router. Resume: the paused programs with a next turn held, then those of one
      turn so far, then the other idle ones, each fewest tokens first (oldest paused on ties), as many as
      fit together under pause_threshold - resume_hysteresis (0.85) of the workers' budgets, are placed
      largest first on the worker with the most headroom: a resumed program may move worker. A held turn
      goes when its program resumes, or after resume_timeout_seconds (1800 s) to the worker with the most
      decayed headroom.

    Not simulated: the soft-demote band (0.80-0.95, priority jump -2 s) and resume_priority_boost (+1 s),
    which reorder Dynamo's router queue, absent from DynamoCost as the simulation runs it (no queue);
    `max_programs` (the source takes SGLang's max_running_requests; none for these vLLM engines). The
    simulated clients send session_final with each session's last turn (SimPolicy.last_turns), as an agent
    harness built for it would: a program is released at its last answer, not after the idle TTL. The
    guide's native frontend plugin (router-policy YAML) replaces this Python router in new deployments; its
    source was not read, so its placement may differ. A retry after a refusal goes elsewhere by DynamoCost,
    the program's pin unchanged.
    """

    name = "dynamo+thunderagent"

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._programs: dict[str, _Program] = {}
        self._paused: dict[str, None] = {}  # insertion order: resume's ties go oldest paused first
        self._send: Callable[[SimRequest], None] = lambda request: None
        self._ticking = False

    def paused_sessions(self) -> list[str]:
        return list(self._paused)

    def replica_of(self, session: str) -> int | None:
        program = self._programs.get(session)
        return None if program is None else program.replica

    def admit(self, request: SimRequest, send: Callable[[SimRequest], None]) -> bool:
        session = request.session
        if session is None:
            return True
        self._send = send
        program = self._programs.get(session)
        new = program is None
        if program is None:
            program = self._programs[session] = _Program(session)
        program.steps += 1
        program.tokens = request.trace.input_tokens
        program.reasoning, program.acting_since, program.turn = True, 0.0, request
        self._keep_ticking()
        if program.paused:
            return self._hold(program, request)
        if program.replica is not None:
            return True
        program.replica = self._placement(program.tokens, queue_behind_paused=new)
        if program.replica is not None or not new:
            return True  # placed; or a running program left unplaced, which DynamoCost routes
        program.paused = True
        self._paused[session] = None
        return self._hold(program, request)

    def route(self, request: SimRequest) -> int:
        program = self._programs.get(request.session) if request.session is not None else None
        if program is None or program.replica is None or program.replica in request.tried:
            return super().route(request)
        return self._book(request, program.replica)

    def _book(self, request: SimRequest, worker: int) -> int:
        """A pinned turn, booked on worker as DynamoCost.route books the worker it chooses."""
        view, size = self.view, self.view.block_size
        chain = request.chain.tolist()
        match = view.matches(chain).get(view.instances[worker].name, NO_MATCH)
        request.uncached_estimate = max(request.trace.input_tokens - match.gpu * size, 0)
        self._active.prefill_tokens[worker] += request.uncached_estimate
        self._active.add(worker, chain, -(-request.trace.input_tokens // size))
        return worker

    def first_token(self, request: SimRequest) -> None:
        super().first_token(request)
        program = self._program_of(request)
        if program is not None and program.replica is None and not program.paused:
            program.replica = request.instance  # the cold-start back-fill: the worker the engine used

    def finished(self, request: SimRequest) -> None:
        super().finished(request)
        program = self._program_of(request)
        if program is None:
            return
        if request.number in self.last_turns:  # the client's session_final: the program is released
            del self._programs[program.session]
            self._paused.pop(program.session, None)
            return
        self._turn_ended(program, request.trace.input_tokens + request.generated)

    def refused(self, request: SimRequest) -> None:
        DynamoCost.first_token(self, request)
        DynamoCost.finished(self, request)
        program = self._program_of(request)
        if program is not None and len(request.tried) + 1 >= min(_ATTEMPTS, len(self.view.instances)):
            self._turn_ended(program, request.trace.input_tokens)

    def _program_of(self, request: SimRequest) -> _Program | None:
        program = self._programs.get(request.session) if request.session is not None else None
        return program if program is not None and program.turn is request else None

    def _turn_ended(self, program: _Program, tokens: int) -> None:
        """after_request: its context counted, acting from now; paused now if it was marked."""
        program.tokens, program.reasoning, program.turn = tokens, False, None
        program.acting_since = self.view.loop.now
        if program.marked:
            program.marked = False
            self._pause(program)
        self._keep_ticking()

    def _hold(self, program: _Program, request: SimRequest) -> bool:
        program.held = request
        self.view.loop.at(self.view.loop.now + RESUME_TIMEOUT_S, lambda: self._force(program, request))
        return False

    def _force(self, program: _Program, request: SimRequest) -> None:
        """The forced resume: still held, the turn goes to the worker with the most decayed headroom."""
        if program.held is not request or not program.paused:
            return
        usage = self._usage()
        target = max(usage, key=lambda n: usage[n].capacity - self._decayed(usage[n]), default=None)
        self._resume(program, target)
        self._let_go(program)

    def _let_go(self, program: _Program) -> None:
        request, program.held = program.held, None
        if request is not None:
            request.queued_s = self.view.loop.now - request.sent_s
            self._send(request)

    def _tokens(self, program: _Program) -> int:
        if program.reasoning:
            return program.tokens
        return int(program.tokens * ACTING_TOKEN_WEIGHT)

    def _decayed(self, entry: _Usage) -> int:
        now, total = self.view.loop.now, 0
        for program in entry.programs:
            if program.reasoning:
                total += program.tokens
            else:
                idle = max(now - program.acting_since, 0.0) if program.acting_since > 0 else 0.0
                total += int(program.tokens * 2.0 ** (-idle / ACTING_DECAY_TAU_S))
        return total + len(entry.programs) * BUFFER_PER_PROGRAM

    def _usage(self) -> dict[int, _Usage]:
        """Each worker's working set. A turn in flight counts its answer so far, as the source adds each
        streamed chunk's tokens to token_total."""
        usage = {
            number: _Usage(instance.kv_capacity_tokens)
            for number, instance in enumerate(self.view.instances)
            if instance.kv_capacity_tokens
        }
        for program in self._programs.values():
            if program.replica is None or program.paused or program.replica not in usage:
                continue
            turn = program.turn
            if program.reasoning and turn is not None:
                program.tokens = turn.trace.input_tokens + turn.generated
            entry = usage[program.replica]
            entry.programs.append(program)
            entry.used += self._tokens(program) + BUFFER_PER_PROGRAM
        return usage

    def _placement(self, tokens: int, queue_behind_paused: bool) -> int | None:
        """Admission's worker: room for tokens + buffer, least decayed load, the first on ties."""
        if queue_behind_paused and self._paused:
            return None
        required, best, best_load = tokens + BUFFER_PER_PROGRAM, None, 0
        for number, entry in self._usage().items():
            if entry.capacity - entry.used < required:
                continue
            load = self._decayed(entry)
            if best is None or load < best_load:
                best, best_load = number, load
        return best

    def _keep_ticking(self) -> None:
        """The scheduler's loop, every SCHEDULER_INTERVAL_S while programs are known (the idle TTL and the
        forced resume see that they all go)."""
        if not self._ticking and self._programs:
            self._ticking = True
            loop = self.view.loop
            loop.at(loop.now + SCHEDULER_INTERVAL_S, self._tick)

    def _tick(self) -> None:
        """Release the idle, then resume, then pause: a program paused in a tick resumes in a later one."""
        self._ticking = False
        self._expire()
        usage = self._usage()
        resumed = self._resume_fitting(usage)
        self._pause_until_safe(usage)
        for program in resumed:
            self._let_go(program)
        self._keep_ticking()

    def _expire(self) -> None:
        now = self.view.loop.now
        for session, program in list(self._programs.items()):
            if (
                program.reasoning
                or program.acting_since <= 0
                or now - program.acting_since < PROGRAM_IDLE_TTL_S
            ):
                continue
            del self._programs[session]
            self._paused.pop(session, None)

    def _pause(self, program: _Program) -> bool:
        if program.paused or program.reasoning:
            return False
        program.paused, program.replica = True, None
        self._paused[program.session] = None
        return True

    def _resume(self, program: _Program, target: int | None) -> None:
        program.paused, program.replica = False, target
        self._paused.pop(program.session, None)

    def _pause_until_safe(self, usage: dict[int, _Usage]) -> None:
        for entry in usage.values():
            if entry.used <= entry.capacity * PAUSE_THRESHOLD:
                continue
            target = entry.capacity * min(PAUSE_TARGET, PAUSE_THRESHOLD)
            acting = sorted((p for p in entry.programs if not p.reasoning), key=lambda p: p.tokens)
            for program in acting:
                if entry.used <= target:
                    break
                freed = self._tokens(program) + BUFFER_PER_PROGRAM
                if program.marked or not self._pause(program):
                    continue
                entry.programs.remove(program)
                entry.used -= freed
            if entry.used > target:  # marking frees nothing now: it pauses them at their answers
                for program in entry.programs:
                    if program.reasoning:
                        program.marked = True

    def _resume_fitting(self, usage: dict[int, _Usage]) -> list[_Program]:
        """Best-fit-decreasing restore under the resume ceiling; the programs resumed."""
        paused = [self._programs[s] for s in self._paused if s in self._programs]
        if not paused:
            return []

        def group(program: _Program) -> int:
            if program.steps <= 1:
                return 1
            return 0 if program.reasoning else 2

        paused.sort(key=lambda p: (group(p), p.tokens))
        ceiling = max(0.0, PAUSE_THRESHOLD - RESUME_HYSTERESIS)
        headroom = [(n, int(entry.capacity * ceiling) - entry.used) for n, entry in usage.items()]
        headroom = sorted((h for h in headroom if h[1] > BUFFER_PER_PROGRAM), key=lambda h: -h[1])
        if not headroom:
            return []
        total, cumulative, fitting = sum(room for _, room in headroom), 0, []
        for program in paused:
            required = program.tokens + BUFFER_PER_PROGRAM
            if cumulative + required <= total:
                fitting.append(program)
                cumulative += required
        if not fitting:
            return []
        fitting.sort(key=lambda p: -p.tokens)
        least = min(p.tokens for p in fitting) + BUFFER_PER_PROGRAM
        resumed = []
        for program in fitting:
            if not headroom or least > headroom[0][1]:
                break
            required = program.tokens + BUFFER_PER_PROGRAM
            chosen = next((i for i, (_, room) in enumerate(headroom) if required <= room), None)
            if chosen is None:
                continue
            worker, room = headroom[chosen]
            self._resume(program, worker)
            usage[worker].programs.append(program)
            usage[worker].used += self._tokens(program) + BUFFER_PER_PROGRAM
            resumed.append(program)
            if room - required > BUFFER_PER_PROGRAM:
                headroom[chosen] = (worker, room - required)
                headroom.sort(key=lambda h: -h[1])
            else:
                headroom.pop(chosen)
        return resumed
