"""vllm-router 0.1.17's session-aware routing, as its source has it (the PyPI sdist of the binary the live
benchmark runs; file paths below are that sdist's), with its defaults. A session is what the client names:
the trace's session, sent as `x-session-id` (SimRequest.session); a trace without sessions names none.

- `sticky_least_loaded` (src/policies/sticky_least_loaded.rs): a session stays on the worker it was first
  given; a new session goes to the worker holding the fewest sessions. Nothing else weighs.
- `kv_aware` with `--kv-aware-session-affinity-ttl-secs` (src/policies/kv_aware.rs): the first request of a
  session is placed by kv_aware's cost and binds the session there; its later requests go there whatever
  the cost, until the binding has been idle for the TTL.
- `kv_aware` with `--enable-program-scheduling` (src/program_scheduling/): a session is a program with a
  home worker; between turns (a tool call) it keeps its place for a TTL it learns; once paused, its next
  turn waits in the router until the home worker's scraped queue is empty.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvroute.simulate.engine import SimRequest
from kvroute.simulate.peers import ConsistentHash, VllmRouterKvAware
from kvroute.simulate.policies import SimPolicy
from kvroute.simulate.view import RouterView

# sticky_least_loaded.rs: DEFAULT_SESSION_EXPIRATION_SECS (VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S), and the
# least interval between sweeps of idle sessions
STICKY_EXPIRATION_S = 7200.0
STICKY_SWEEP_S = 60.0
# The flag has no default (affinity is off without it); 300 s is the value its own validation test sets.
AFFINITY_TTL_S = 300.0
AFFINITY_MAX_RECORDS = 10_000  # kv_aware.rs KV_AFFINITY_MAX_RECORDS
# Program scheduling's defaults in regular (not P/D) mode: config/types.rs, scheduler_state.rs, policy.rs.
PROGRAM_METRICS_INTERVAL_S = 1.0  # metrics_interval_seconds: /metrics observed, decisions ticked
PROGRAM_WAITING_THRESHOLD = 1  # admission_waiting_request_threshold: no admission while 1 waits
PROGRAM_MAX_ACTIVE = 64  # max_active_programs_per_target
PROGRAM_MAX_ACTING_TTL_S = 10.0  # max_acting_ttl_seconds
PROGRAM_STATS_WINDOW = 100  # stats_window_size: intervals before a TTL is fitted (0 s until then)
PROGRAM_PAUSED_RETENTION_S = 1800.0  # paused_retention_ttl_seconds
# PrefillCostModel's offline calibration: a cache miss of x thousand tokens costs
# (intercept + linear x + quadratic x^2) x (2 - decode_throughput_alpha) seconds.
PREFILL_COST = (0.06600061907132926, 0.05702024012166613, 0.0044057347937978475)
DECODE_THROUGHPUT_ALPHA = 0.15


def _rendezvous(key: str, candidates: Iterable[int], urls: Sequence[str]) -> int:
    """The candidate whose hash of `key:url` is highest, the first on ties (crc32 for vllm-router's
    fbi_hash, as ConsistentHash has it)."""
    best, best_weight = -1, -1
    for number in candidates:
        weight = zlib.crc32(f"{key}:{urls[number]}".encode())
        if weight > best_weight:
            best, best_weight = number, weight
    return best


class VllmRouterSticky(SimPolicy):
    """vllm-router `sticky_least_loaded`: a session's requests go to the worker it was assigned; a new
    session to the worker with the fewest sessions assigned, ties broken by rendezvous hashing of the session
    id. Sessions are released by the client's `/finish_session` (the simulated client sends none, as the
    live replay sends none) or after `expiration_s` idle, swept at most every `sweep_interval_s` and checked
    on use. A request without a session goes to the worker with the fewest sessions, ties by the hash of its
    text (the prompt's), and is not recorded. In-flight requests and the KV index are never read. A worker
    that refused a request counts as unavailable for its retry: its session is reassigned, as the source
    reassigns one whose worker is unhealthy.

    The session id is the first non-empty of the headers x-session-id, x-user-id, x-tenant-id,
    x-correlation-id, x-request-id, x-trace-id, then the body's session_params.session_id, user, session_id,
    user_id (src/policies/hash_key.rs extract_session_id).
    """

    name = "vllm-router-sticky"

    def __init__(self, expiration_s: float = STICKY_EXPIRATION_S, sweep_interval_s: float = STICKY_SWEEP_S):
        self._expiration_s, self._sweep_interval_s = expiration_s, sweep_interval_s

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._urls = [instance.url for instance in view.instances]
        self._sessions: dict[str, tuple[int, float]] = {}  # session: (worker, last request)
        self._counts = [0] * len(view.instances)
        self._last_sweep = view.loop.now

    @property
    def sessions_per_worker(self) -> list[int]:
        return list(self._counts)

    def route(self, request: SimRequest) -> int:
        now = self.view.loop.now
        self._sweep(now)
        candidates = [n for n in range(len(self._counts)) if n not in request.tried] or list(
            range(len(self._counts))
        )
        session = request.session
        if session is None:
            return self._least_loaded(candidates, str(zlib.crc32(request.token_keys().tobytes())))
        assigned = self._sessions.get(session)
        if assigned is not None:
            worker, last = assigned
            if now - last < self._expiration_s and worker in candidates:
                self._sessions[session] = (worker, now)
                return worker
            self._forget(session)
        chosen = self._least_loaded(candidates, session)
        self._sessions[session] = (chosen, now)
        self._counts[chosen] += 1
        return chosen

    def _least_loaded(self, candidates: list[int], key: str) -> int:
        low = min(self._counts[n] for n in candidates)
        return _rendezvous(key, (n for n in candidates if self._counts[n] == low), self._urls)

    def _forget(self, session: str) -> None:
        worker, _ = self._sessions.pop(session)
        self._counts[worker] -= 1

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < self._sweep_interval_s:
            return
        self._last_sweep = now
        for session in [s for s, (_, last) in self._sessions.items() if now - last >= self._expiration_s]:
            self._forget(session)


@dataclass
class _Binding:
    """One session's affinity record: its worker, the requests holding it, when it expires once idle."""

    worker: int
    in_flight: int = 1
    idle_until: float = math.inf


class VllmRouterKvAwareAffinity(VllmRouterKvAware):
    """vllm-router `kv_aware` with `--kv-aware-session-affinity-ttl-secs`: a session's first request is
    placed by kv_aware's cost and binds the session to that worker; its later requests go there, whatever
    the cost and the load, while the binding lives. A binding expires `ttl_s` after its last request in
    flight ended (a request in flight keeps it); a retry away from the bound worker leaves the binding as
    it is. At most `max_records` bindings, the least recently used idle one evicted for a new one (none
    free: the session routes by cost, unbound). The session is the agentic context's, agent_hint's, a
    framework header's (x-claude-code-session-id, session-id, x-session-id) or the body's session_id
    (src/request_identity.rs resolve_affinity_identity); requests without one route by cost.

    A bound request is still charged its new prefill tokens: the simulated client sends token ids, which
    the router hashes without asking a worker to render them.
    """

    name = "vllm-router-kv-aware+affinity"

    def __init__(self, ttl_s: float = AFFINITY_TTL_S, max_records: int = AFFINITY_MAX_RECORDS) -> None:
        self._ttl_s, self._max_records = ttl_s, max_records

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._bindings: OrderedDict[str, _Binding] = OrderedDict()  # least recently used first

    def bound_worker(self, session: str) -> int | None:
        binding = self._bindings.get(session)
        return None if binding is None else binding.worker

    def route(self, request: SimRequest) -> int:
        session = request.session
        if session is None:
            return super().route(request)
        binding = self._acquire(session)
        if binding is not None and binding.worker not in request.tried:
            request.policy_state = binding
            return self.place(request, binding.worker, self.new_prefill_tokens(request)[binding.worker])
        if binding is not None:
            self._release(binding)
            return super().route(request)
        chosen = super().route(request)
        request.policy_state = self._bind(session, chosen)
        return chosen

    def finished(self, request: SimRequest) -> None:
        self._release_of(request)

    def refused(self, request: SimRequest) -> None:
        super().refused(request)
        self._release_of(request)

    def _acquire(self, session: str) -> _Binding | None:
        binding = self._bindings.get(session)
        if binding is None:
            return None
        if binding.in_flight == 0 and binding.idle_until <= self.view.loop.now:
            del self._bindings[session]
            return None
        self._bindings.move_to_end(session)
        binding.in_flight += 1
        return binding

    def _bind(self, session: str, worker: int) -> _Binding | None:
        if session not in self._bindings and len(self._bindings) >= self._max_records:
            idle = next((key for key, binding in self._bindings.items() if binding.in_flight == 0), None)
            if idle is None:
                return None
            del self._bindings[idle]
        binding = self._bindings[session] = _Binding(worker)
        self._bindings.move_to_end(session)
        return binding

    def _release(self, binding: _Binding) -> None:
        binding.in_flight -= 1
        if binding.in_flight == 0:
            binding.idle_until = self.view.loop.now + self._ttl_s

    def _release_of(self, request: SimRequest) -> None:
        if isinstance(request.policy_state, _Binding):
            self._release(request.policy_state)
            request.policy_state = None


def cache_miss_impact_s(uncached_tokens: int) -> float:
    """Program scheduling's cost of recomputing uncached_tokens (policy.rs cache_miss_impact_seconds)."""
    if uncached_tokens <= 0:
        return 0.0
    x = uncached_tokens / 1000.0
    intercept, linear, quadratic = PREFILL_COST
    return (intercept + linear * x + quadratic * x * x) * (2.0 - DECODE_THROUGHPUT_ALPHA)


def _normal_cdf(value: float) -> float:
    """policy.rs normal_cdf: Abramowitz-Stegun's erf."""
    x = abs(value / math.sqrt(2.0))
    t = 1.0 / (1.0 + 0.3275911 * x)
    polynomial = (
        ((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592
    ) * t
    erf = math.copysign(1.0 - polynomial * math.exp(-x * x), value)
    return min(max(0.5 * (1.0 + erf), 0.0), 1.0)


def fitted_acting_ttl(
    intervals: Sequence[float], impact_s: float, window: int = PROGRAM_STATS_WINDOW, max_s: float = 10.0
) -> float:
    """policy.rs fitted_acting_ttl: 0 until `window` intervals between a program's answer and its next
    request; then, of a log-normal fit of the positive ones, the TTL d in 0 .. min(max_s, impact_s)
    maximising P(T < d) impact - E[T; T < d] - d P(T >= d) (0 where every candidate loses)."""
    if len(intervals) < window:
        return 0.0
    logs = [math.log(i) for i in intervals if math.isfinite(i) and i > 0.0]
    longest = min(max_s, impact_s)
    if not logs or longest <= 0.0 or impact_s <= 0.0:
        return 0.0
    mean = sum(logs) / len(logs)
    sigma = max(math.sqrt(sum((v - mean) ** 2 for v in logs) / len(logs)), 1e-6)
    shortest = min(0.05, longest)
    candidates = [0.0, shortest, longest]
    if longest > shortest:
        low, high = math.log(shortest), math.log(longest)
        candidates += [math.exp(low + (high - low) * k / 31) for k in range(32)]
    lognormal_mean = math.exp(mean + sigma * sigma / 2.0)
    best, best_utility = 0.0, -math.inf
    for ttl in candidates:
        utility = 0.0
        if ttl > 0.0:
            hit = _normal_cdf((math.log(ttl) - mean) / sigma)
            truncated = lognormal_mean * _normal_cdf((math.log(ttl) - mean - sigma * sigma) / sigma)
            utility = impact_s * hit - truncated - ttl * (1.0 - hit)
        if utility >= best_utility:
            best, best_utility = ttl, utility
    return 0.0 if best_utility < 0.0 else best


@dataclass
class _Program:
    """One program (session) as the scheduler keeps it: active (holding its place on home) or paused."""

    home: int
    active: bool = False
    reasoning: bool = True  # a request of it waits or runs; else acting (a tool call)
    in_flight: int = 0
    held: deque[SimRequest] = field(default_factory=deque)
    queued_s: float = math.inf
    acting_until: float = math.inf
    last_finished_s: float | None = None
    paused_s: float | None = None


class VllmRouterKvAwarePrograms(VllmRouterKvAware):
    """vllm-router `kv_aware` with `--enable-program-scheduling`, its defaults in regular mode (no token
    capacity given, so capacity repair, growth reserve and batch-gain admission are off):

    - A session is a program (the client sends `vllm_xargs.agentic_context`, the default enable key; with
      `program_scheduling_enable_key: auto` an x-session-id header is enough). Its home worker is the
      consistent hash of its session (binding_strategy consistent_hash, 160 virtual nodes), and every one
      of its requests goes there: kv_aware only books the forced worker's load. Requests without a session
      route by kv_aware's cost.
    - An active program's requests go at once. After its last answer it acts (a tool call) and keeps its
      place for its TTL, then pauses. A paused program's next request waits in its home's queue until the
      home's scraped vllm:num_requests_waiting is below 1 and fewer than 64 programs are active there; then
      the queued programs are admitted, the most recently answered first. Decisions run on every arrival,
      answer and tick (every second, after /metrics is read).
    - The TTL is 0 s until the home has seen 100 intervals between a program's answer and its next request;
      then fitted to them (log-normal), at most 10 s and the cost of recomputing the prompt (vLLM reports
      no cached tokens by default, so the whole prompt).

    Not simulated: force-resume (30-300 s, which lifts only the 64-program cap), the max-segment yield
    (it counts cache-continuous rounds from cached-token reports vLLM does not send by default), the 600 s
    queue timeout; a retry goes elsewhere, where vllm-router retries the same forced worker.
    """

    name = "vllm-router-kv-aware+programs"
    scrape_interval_s = PROGRAM_METRICS_INTERVAL_S

    def __init__(
        self,
        waiting_threshold: int = PROGRAM_WAITING_THRESHOLD,
        max_active: int = PROGRAM_MAX_ACTIVE,
        max_acting_ttl_s: float = PROGRAM_MAX_ACTING_TTL_S,
        window: int = PROGRAM_STATS_WINDOW,
        paused_retention_s: float = PROGRAM_PAUSED_RETENTION_S,
    ) -> None:
        self._waiting_threshold, self._max_active = waiting_threshold, max_active
        self._max_ttl_s, self._window, self._retention_s = max_acting_ttl_s, window, paused_retention_s

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._ring = ConsistentHash()
        self._ring.bind(view)
        self._programs: dict[str, _Program] = {}
        self._intervals: list[deque[float]] = [deque(maxlen=self._window) for _ in view.instances]
        self._active_on = [0] * len(view.instances)
        self._send: Callable[[SimRequest], None] = lambda request: None
        self._ticking = False

    def acting_ttl_s(self, worker: int, prompt_tokens: int) -> float:
        return fitted_acting_ttl(
            self._intervals[worker], cache_miss_impact_s(prompt_tokens), self._window, self._max_ttl_s
        )

    def admit(self, request: SimRequest, send: Callable[[SimRequest], None]) -> bool:
        session = request.session
        if session is None:
            return True
        self._send, now = send, self.view.loop.now
        program = self._programs.get(session)
        if program is None:
            program = self._programs[session] = _Program(home=self._ring.route(request))
        elif program.in_flight == 0 and program.last_finished_s is not None:
            self._intervals[program.home].append(now - program.last_finished_s)
        program.reasoning, program.acting_until = True, math.inf
        if program.active:
            self._decide(now)
            program.in_flight += 1
            return True
        program.held.append(request)
        program.queued_s = min(program.queued_s, now)
        self._decide(now)
        return False

    def route(self, request: SimRequest) -> int:
        program = self._programs.get(request.session) if request.session is not None else None
        if program is None or not program.active or program.home in request.tried:
            return super().route(request)
        return self.place(request, program.home, self.new_prefill_tokens(request)[program.home])

    def finished(self, request: SimRequest) -> None:
        program = self._programs.get(request.session) if request.session is not None else None
        if program is None or program.in_flight == 0:
            return
        now = self.view.loop.now
        program.in_flight -= 1
        program.last_finished_s = now
        if program.in_flight == 0 and not program.held:
            program.reasoning = False
            program.acting_until = now + self.acting_ttl_s(program.home, request.trace.input_tokens)
        self._decide(now)

    def _decide(self, now: float) -> None:
        """The scheduler's decisions (scheduler_lifecycle.rs run_periodic_decisions): TTLs run out, long
        paused programs are forgotten, queued programs are admitted where their home lets them."""
        for session, program in list(self._programs.items()):
            if (
                program.active
                and not program.reasoning
                and program.in_flight == 0
                and program.acting_until <= now
            ):
                program.active, program.paused_s, program.acting_until = False, now, math.inf
                self._active_on[program.home] -= 1
            elif (
                not program.active
                and not program.held
                and program.paused_s is not None
                and now - program.paused_s >= self._retention_s
            ):
                del self._programs[session]
        queued = sorted(
            (p for p in self._programs.values() if not p.active and p.held),
            key=lambda p: (-(p.last_finished_s if p.last_finished_s is not None else -math.inf), p.queued_s),
        )
        for program in queued:
            if self._admits(program.home):
                self._activate(program, now)
        self._keep_ticking()

    def _admits(self, worker: int) -> bool:
        load = self.view.instances[worker].load
        blocked = load is not None and load.waiting >= self._waiting_threshold
        return not blocked and self._active_on[worker] + 1 <= self._max_active

    def _activate(self, program: _Program, now: float) -> None:
        program.active, program.queued_s, program.paused_s = True, math.inf, None
        self._active_on[program.home] += 1
        while program.held:
            request = program.held.popleft()
            request.queued_s = now - request.sent_s
            program.in_flight += 1
            self._send(request)

    def _keep_ticking(self) -> None:
        """Ticks every metrics interval while a program waits or acts, as the scheduler's loop ticks."""
        if self._ticking or not any(p.held or p.acting_until < math.inf for p in self._programs.values()):
            return
        self._ticking = True
        loop = self.view.loop
        loop.at(loop.now + PROGRAM_METRICS_INTERVAL_S, self._tick)

    def _tick(self) -> None:
        self._ticking = False
        self._decide(self.view.loop.now)
