"""Agent programs as the router follows them.

A program is the turns of one session (its key: the router's digest of the client's session key). While one
of its turns runs, and for the learned time-to-live once it is answered (the program runs a tool, and will
send its next turn with the context grown), the program's KV working set is its last turn's prompt at that
turn's instance. At its next turn the router tells whether that KV was still there, by the index's matches
for the new prompt: kept at the instance, elsewhere (another instance or the pool holds it), or lost.

Under KV pressure (programs.pause_above) the programs in a tool call at an instance whose working sets fill
its cache are paused, the longest in it first: their working sets are given up, so that those running keep
theirs, and their next turns wait for room as programs back (router/programs/admission.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from router.metrics import RouterMetrics
from router.programs.admission import ProgramGate
from router.programs.settings import ProgramsConfig
from router.programs.tool_calls import ToolCalls
from router.upstreams.instances import Instance
from scorers.request import RoutingRequest

# What a turn found of its program's KV: first (a program new, or forgotten), kept (the instance of its last
# turn still held that turn's prompt, but for one block), elsewhere (only another instance or the pool held
# it), lost (nothing did), unknown (a prompt routed without prefix knowledge). A turn sent while another of
# its program's runs (a side request, a subagent) is concurrent, and not a next turn.
Found = Literal["first", "kept", "elsewhere", "lost", "unknown", "concurrent"]
Counted = Literal["running", "tool_call"]
# The most tool-call lapses, and the most idle programs forgotten, that one look at the clock handles: 65,536
# programs lapsing at once held the event loop about 100 ms. The rest go at the next looks (each request's,
# each scrape's); a program looked up meanwhile has its own lapse applied first (_expire's looked_up).
EXPIRY_BATCH = 1_024


@dataclass(slots=True)
class Program:
    instance: str  # where its working set is: the instance of its last main turn
    tokens: int  # that turn's prompt
    last_seen: float
    running: int = 0  # its turns in flight through this router
    running_elsewhere: int = 0  # and through its peers (replicas sharing a store: router/programs/shared.py)
    ended_at: float | None = None  # its last answer's end, once none of its turns runs
    counted: Counted | None = None  # how its working set is counted now
    paused: bool = False  # its working set given up under KV pressure, until its next turn
    warmed: bool = False  # its last prompt was prefilled at its instance while its tool ran (warm_ups.py)


@dataclass(slots=True)
class WorkingSets:
    """An instance's programs: those with a turn running, those in a tool call within the time-to-live,
    and their prompts' tokens."""

    running: int = 0
    tool_call: int = 0
    tokens: int = 0
    paused: int = 0
    warmed: int = 0  # of those in a tool call, the programs whose working set a warm-up brought here


class Programs:
    def __init__(
        self, settings: ProgramsConfig, metrics: RouterMetrics, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._settings, self._metrics, self._clock = settings, metrics, clock
        self._programs: OrderedDict[str, Program] = OrderedDict()  # the least recently heard from first
        # Those counted in a tool call, by when it began, the earliest first: they leave it in this order.
        self._in_tool_calls: OrderedDict[str, float] = OrderedDict()
        self._sets: dict[str, WorkingSets] = {}
        self._changed: set[str] = set()
        self.tool_calls = ToolCalls(settings)
        # Told each instance's working set tokens and programs alive as they change: the scorers read them
        # there.
        self.on_working_set: Callable[[str, int, int], None] = _ignored
        self.capacity: Callable[[str], int | None] = _unknown  # an instance's KV cache tokens, if known
        self.gate: ProgramGate[object] = ProgramGate(settings.start_below, settings.max_wait_s, clock)
        # Told each turn this router starts (key, instance, prompt tokens) and ends (key, "", 0), for peers.
        self.on_turn: Callable[[str, str, int], None] | None = None

    def known(self, session_key: str) -> bool:
        """Whether the program with this key is followed (alive, or its working set lapsed or paused)."""
        return session_key in self._programs

    def starts_now(self, prompt_tokens: int, candidates: Sequence[Instance]) -> bool:
        """Whether a program's first turn (prompt_tokens) goes past the gate now, by the working sets as
        they stand; if not, it waits there (gate.hold())."""
        self.expire()
        return self.gate.goes_now(prompt_tokens, candidates)

    def let_go(self) -> list[object]:
        """The programs waiting at the gate that may go now, by the working sets as they stand."""
        if not len(self.gate):
            return []
        self.expire()
        return self.gate.release()

    @property
    def come_back(self) -> bool:
        """Whether most programs come back for another turn after their tool call (ToolCalls.come_back)."""
        return self.tool_calls.come_back

    def placed_anew(self, session_key: str) -> bool:
        """Whether a request of this program is placed as one starting (the program-room scorer): it is not
        alive (new, or back after its working set lapsed), or its instance holds more working sets than its
        KV cache, so that its programs evict one another's contexts turn after turn and one of them is
        better moved where there is room (it computes its context again once, not every turn). Of those, only
        a program whose working set is no larger than the mean there moves: a move costs the mover its whole
        context: an 80K-token program moved waits seconds for its first token, a small one a fraction of
        that."""
        if not self.alive(session_key):
            return True
        program = self._programs[session_key]
        capacity, sets = self.capacity(program.instance), self._sets.get(program.instance)
        if capacity is None or sets is None or sets.tokens <= capacity:
            return False
        return program.tokens * (sets.running + sets.tool_call) <= sets.tokens

    def alive(self, session_key: str) -> bool:
        """Whether the program with this key has a turn running, or is in a tool call within the time-to-live:
        its working set is counted. A request of a program not alive (new, or back after its working set
        lapsed) starts it anew, wherever there is room for it (scorers/program_room.py)."""
        program = self._programs.get(session_key)
        if program is None:
            return False
        now = self._clock()
        self._expire(now, session_key)
        return program.counted is not None

    def __len__(self) -> int:
        return len(self._programs)

    def working_sets(self) -> dict[str, WorkingSets]:
        """Each instance's programs as they stand now (the time-to-live applied)."""
        self.expire()
        return {
            name: WorkingSets(s.running, s.tool_call, s.tokens, s.paused, s.warmed)
            for name, s in self._sets.items()
        }

    def turn_started(self, request: RoutingRequest, instance: str, sent_at: float) -> Found | None:
        """A turn of request's program (None: it has no session key) is answered by instance; sent_at: when
        the router first sent it (the clock's time)."""
        key = request.session_key
        if key is None:
            return None
        self._expire(sent_at, key)
        self._forget_if_idle(key, sent_at)
        program = self._programs.get(key)
        found: Found = "concurrent"
        if program is None:
            program = self._programs[key] = Program(instance, request.prompt_tokens, sent_at)
            found = "first"
            self._metrics.program_turns("first", "none").inc()
        else:
            self._programs.move_to_end(key)
            program.last_seen = sent_at
            if not program.running and not program.running_elsewhere and program.ended_at is not None:
                found = self._next_turn(program, request, sent_at)
            if program.paused:
                self._resumed(program)
        self.gate.counted(key)
        if program.counted == "tool_call":
            self.tool_calls.tool_call_ended(next_turn=True)
        self._uncount(key, program)
        program.warmed = False
        program.running += 1
        if request.prompt_tokens >= program.tokens // 2:  # a side request's short prompt moves nothing
            program.instance, program.tokens = instance, request.prompt_tokens
        self._count(key, program, sent_at)
        self._forget_idle(sent_at)
        self._publish()
        if self.on_turn is not None:
            self.on_turn(key, program.instance, program.tokens)
        return found

    def turn_ended(self, session_key: str | None) -> None:
        """A turn of the program whose key this is was answered (or failed, or was left)."""
        self.gate.counted(session_key)
        program = None if session_key is None else self._programs.get(session_key)
        if program is None or not program.running:
            return
        assert session_key is not None
        self._ended(session_key, program, own=1, elsewhere=0)
        if self.on_turn is not None:
            self.on_turn(session_key, "", 0)

    def started_elsewhere(self, key: str, instance: str, tokens: int) -> None:
        """A peer router started a turn of the program at instance, its working set now tokens there."""
        now = self._clock()
        self._expire(now, key)
        self._forget_if_idle(key, now)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = Program(instance, tokens, now)
        else:
            self._programs.move_to_end(key)
            program.last_seen = now
            if program.paused:
                self._resumed(program)
        if program.counted == "tool_call":
            self.tool_calls.tool_call_ended(next_turn=True)
        self._uncount(key, program)
        program.warmed = False
        program.running_elsewhere += 1
        program.instance, program.tokens = instance, tokens
        self._count(key, program, now)
        self._forget_idle(now)
        self._publish()

    def ended_elsewhere(self, key: str, turns: int = 1) -> None:
        """turns of the program that peers started ended (answered, or their router was lost)."""
        program = self._programs.get(key)
        if program is None or not program.running_elsewhere:
            return
        self._ended(key, program, own=0, elsewhere=min(turns, program.running_elsewhere))

    def _ended(self, key: str, program: Program, own: int, elsewhere: int) -> None:
        """own of the program's turns through this router and elsewhere of its peers' ended: once none
        runs, it is in its tool call."""
        now = self._clock()
        self._expire(now)
        self._uncount(key, program)
        program.running -= own
        program.running_elsewhere -= elsewhere
        program.last_seen = now
        if not program.running and not program.running_elsewhere:
            program.ended_at = now
        self._count(key, program, now)
        self._publish()

    def expire(self) -> None:
        """The tool calls past the time-to-live no longer counted, programs idle past their end forgotten,
        and the metrics told."""
        now = self._clock()
        self._expire(now)
        self._forget_idle(now)
        self._publish()

    def moved(self, session_key: str, instance: str) -> bool:
        """The program in its tool call had its last prompt warmed up at instance: its working set is
        counted there from now on. False: it is no longer in a tool call (its next turn came, or its
        time-to-live lapsed, or it was paused)."""
        program = self._programs.get(session_key)
        now = self._clock()
        self._expire(now, session_key)
        if program is None or program.counted != "tool_call":
            return False
        # Counted again, it is the last of those in a tool call: it lapses once those before it have, moments
        # after its own time-to-live (a warm-up is sent as its turn ends).
        self._uncount(session_key, program)
        program.instance, program.warmed = instance, True
        self._count(session_key, program, self._clock())
        self._publish()
        return True

    def at(self, instance: str) -> WorkingSets | None:
        """The instance's programs as counted now (the time-to-live as of the last look)."""
        return self._sets.get(instance)

    def _next_turn(self, program: Program, request: RoutingRequest, sent_at: float) -> Found:
        assert program.ended_at is not None
        length = sent_at - program.ended_at
        within = "within_ttl" if length <= self.tool_calls.ttl_s else "past_ttl"
        self.tool_calls.observe(length)
        self._metrics.program_tool_call_seconds.observe(length)
        self._metrics.program_ttl_seconds.set(self.tool_calls.ttl_s)
        found = _kv_found(program, request)
        self._metrics.program_turns(found, within).inc()
        if program.warmed:
            self._metrics.program_warm_ups_found(found).inc()
        return found

    def _count(self, key: str, program: Program, now: float) -> None:
        if program.running or program.running_elsewhere:
            counted: Counted = "running"
        elif program.ended_at is not None and now - program.ended_at <= self.tool_calls.ttl_s:
            counted = "tool_call"
            self._in_tool_calls[key] = program.ended_at
        else:
            return
        sets = self._sets.get(program.instance)
        if sets is None:
            sets = self._sets[program.instance] = WorkingSets()
        if counted == "running":
            sets.running += 1
        else:
            sets.tool_call += 1
        sets.tokens += program.tokens
        sets.warmed += program.warmed
        program.counted = counted
        self._changed.add(program.instance)

    def _uncount(self, key: str, program: Program) -> None:
        if program.counted is None:
            return
        sets = self._sets[program.instance]
        if program.counted == "running":
            sets.running -= 1
        else:
            sets.tool_call -= 1
            del self._in_tool_calls[key]
        sets.tokens -= program.tokens
        sets.warmed -= program.warmed
        program.counted = None
        self._changed.add(program.instance)

    def _expire(self, now: float, looked_up: str | None = None) -> None:
        """The tool calls past the time-to-live lapsed, the earliest first, a batch at a time; and the one of
        the program looked_up, if past it, though earlier ones wait for the next look."""
        ttl = self.tool_calls.ttl_s
        for _ in range(EXPIRY_BATCH):
            if not self._in_tool_calls:
                break
            key, began = next(iter(self._in_tool_calls.items()))
            if now - began <= ttl:
                break
            self._lapse(key)
        if looked_up is not None and now - self._in_tool_calls.get(looked_up, now) > ttl:
            self._lapse(looked_up)

    def _lapse(self, key: str) -> None:
        self.tool_calls.tool_call_ended(next_turn=False)
        self._uncount(key, self._programs[key])

    def _forget_if_idle(self, key: str, now: float) -> None:
        """The program forgotten, if idle past its end, though earlier ones wait for a look."""
        program = self._programs.get(key)
        if program is not None and now - program.last_seen > self._settings.idle_end_s:
            self._forget(key, program)

    def _forget_idle(self, now: float) -> None:
        settings = self._settings
        for _ in range(EXPIRY_BATCH):
            if not self._programs:
                break
            key, program = next(iter(self._programs.items()))
            if (
                now - program.last_seen <= settings.idle_end_s
                and len(self._programs) <= settings.max_programs
            ):
                break
            self._forget(key, program)

    def _forget(self, key: str, program: Program) -> None:
        self._uncount(key, program)
        if program.paused:
            self._resumed(program)
        del self._programs[key]

    def _resumed(self, program: Program) -> None:
        program.paused = False
        self._sets[program.instance].paused -= 1
        self._changed.add(program.instance)

    def _pause(self, name: str, sets: WorkingSets) -> None:
        """Past pause_above of the instance's KV cache, its programs in a tool call give up their working
        sets, the longest in it first, until the rest are under pause_to."""
        above = self._settings.pause_above
        if above is None or not sets.tool_call:
            return
        capacity = self.capacity(name)
        if not capacity or sets.tokens <= above * capacity:
            return
        target = self._settings.pause_to * capacity
        for key in [k for k in self._in_tool_calls if self._programs[k].instance == name]:
            program = self._programs[key]
            self._uncount(key, program)
            program.paused = True
            sets.paused += 1
            self._metrics.program_pauses(name).inc()
            if sets.tokens <= target:
                break

    def _publish(self) -> None:
        metrics = self._metrics
        for name in list(self._changed):
            self._pause(name, self._sets[name])
        for name in self._changed:
            sets = self._sets[name]
            metrics.programs(name, "running").set(sets.running)
            metrics.programs(name, "tool_call").set(sets.tool_call)
            metrics.programs(name, "paused").set(sets.paused)
            metrics.program_working_set_tokens(name).set(sets.tokens)
            self.on_working_set(name, sets.tokens, sets.running + sets.tool_call)
        self._changed.clear()


def _kv_found(program: Program, request: RoutingRequest) -> Found:
    """What the next turn (request) found of the KV its program's last turn left: by the index's matches for
    its prompt, up to the blocks the two prompts share at most."""
    block_size = request.block_size
    expected = min(program.tokens // block_size, max(request.prompt_tokens - 1, 0) // block_size)
    if expected == 0:
        return "unknown"
    enough = max(
        expected - 1, 1
    )  # the last block of the turn's prompt may end where the chat's rendering differs
    match = request.matches.get(program.instance)
    if match is not None and match.gpu + match.cpu >= enough:
        return "kept"
    if any(m.gpu + m.cpu + m.pool >= enough for m in request.matches.values()):
        return "elsewhere"
    return "lost"


def _ignored(name: str, tokens: int, programs: int) -> None:
    pass


def _unknown(name: str) -> int | None:
    return None


class NoPrograms:
    """Programs not followed (programs.enabled: false): none ever starts."""

    gate: ProgramGate[object] = ProgramGate(None, 0.0)

    come_back = False

    def placed_anew(self, session_key: str) -> bool:
        return False

    def alive(self, session_key: str) -> bool:
        return True

    def known(self, session_key: str) -> bool:
        return True

    def starts_now(self, prompt_tokens: int, candidates: Sequence[Instance]) -> bool:
        return True

    def let_go(self) -> list[object]:
        return []

    def turn_started(self, request: RoutingRequest, instance: str, sent_at: float) -> Found | None:
        return None

    def turn_ended(self, session_key: str | None) -> None:
        pass

    def expire(self) -> None:
        pass

    def working_sets(self) -> dict[str, WorkingSets]:
        return {}


NO_PROGRAMS = NoPrograms()


def followed(
    settings: ProgramsConfig,
    metrics: RouterMetrics,
    on_working_set: Callable[[str, int, int], None],
    capacity: Callable[[str], int | None],
    clock: Callable[[], float] = time.perf_counter,
) -> Programs | NoPrograms:
    """The programs a router follows as settings say (none when programs.enabled is false), telling
    on_working_set each instance's working set tokens and programs alive as they change, and pausing by
    capacity's KV cache tokens of an instance: the proxy's and the simulator's."""
    if not settings.enabled:
        return NO_PROGRAMS
    programs = Programs(settings, metrics, clock)
    programs.on_working_set, programs.capacity = on_working_set, capacity
    return programs
