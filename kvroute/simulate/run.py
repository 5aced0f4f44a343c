"""One simulation: a trace through a fleet of engines behind one policy, and what came out of it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.engine import Engine, SimRequest
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.policies import SimPolicy, priors_for
from kvroute.simulate.pool import PoolStore
from kvroute.simulate.view import RouterView
from kvroute.traces import TraceRequest
from router.dispatch.memory_gate import MemoryGate
from router.scoring.ttft_model import TTFTPriors

RESULT_FIELDS = (
    "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "throughput_rps", "local_hit_rate",
    "pool_hit_rate", "ideal_hit_rate", "load_imbalance", "rejected",
)  # fmt: skip


@dataclass
class RunResult:
    policy: str
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    throughput_rps: float
    local_hit_rate: float
    pool_hit_rate: float
    ideal_hit_rate: float
    load_imbalance: float  # max / mean busy time over instances
    rejected: int
    completed: int = 0
    utilization: float = 0.0  # mean busy time / the span from the first arrival to the last finish
    requests_per_instance: list[int] = field(default_factory=list)
    busy_per_instance_s: list[float] = field(default_factory=list)
    longest_session_s: float = 0.0  # longest_session_active: about the busiest instance's time, without moves
    tail: dict[str, float] = field(default_factory=dict)  # where the slowest 1% of TTFTs went (tail_of)
    wall_s: float = 0.0

    def summary(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in RESULT_FIELDS}


def session_of(request: TraceRequest) -> str | None:
    """The session a client would name: the trace's, or for traces without one (Mooncake's), the
    conversation, named by its first block after the shared first one."""
    if request.session is not None:
        return request.session
    return f"conversation-{request.block_ids[1] if len(request.block_ids) > 1 else request.block_ids[0]}"


def simulate(
    blocks: TraceBlocks,
    fleet: FleetSpec,
    policy: SimPolicy,
    ideal_hit_rate: float,
    priors: TTFTPriors | None = None,
    progress: Callable[[int], None] | None = None,
    tie_seed: int = 0,
) -> RunResult:
    started = time.perf_counter()
    loop = EventLoop()
    pool = PoolStore(fleet.pool_blocks()) if fleet.pool is not None else None
    load_s = fleet.pool.load_s_per_token if fleet.pool is not None else 0.0
    engines = [Engine(n, fleet.engine, blocks, loop, pool, load_s) for n in range(fleet.instances)]
    view = RouterView(fleet, loop, engines, pool, priors or priors_for(fleet), tie_seed=tie_seed)
    policy.bind(view)
    trace = blocks.trace.requests
    done: list[SimRequest] = []
    rejected = 0
    outstanding = 0  # sent and not finished, held in the router included
    hold: MemoryGate[SimRequest] = MemoryGate(policy.memory_hold_s, loop.clock)

    def first_token(request: SimRequest) -> None:
        instance = policy.instances_for(request)[request.instance]
        instance.own_pending_prefill_tokens -= request.uncached_estimate
        policy.first_token(request)

    def finish(request: SimRequest) -> None:
        nonlocal outstanding
        policy.instances_for(request)[request.instance].end(request.trace.input_tokens, chain=request.chain)
        policy.finished(request)
        done.append(request)
        outstanding -= 1
        release(request)
        release_held()

    def release_held() -> None:
        """Memory freed up: the requests held in the router that now fit go
        (router/dispatch/memory_gate.py)."""
        if len(hold):
            for held in hold.release():
                hold.started(held.trace.input_tokens)
                dispatch(held)

    # An agent sends its next turn only once it has the answer to the previous one: a session's turn waits
    # for that, however early the trace has it (traces without sessions are open loop).
    busy_sessions: set[str] = set()
    held_back: dict[str, deque[int]] = {}

    def release(request: SimRequest) -> None:
        session = request.trace.session
        if session is None:
            return
        waiting = held_back.get(session)
        if waiting:
            number = waiting.popleft()
            if not waiting:
                del held_back[session]
            submit(number)
        else:
            busy_sessions.discard(session)

    for engine in engines:
        engine.on_first_token, engine.on_finish = first_token, finish

    def arrive(number: int) -> None:
        if number + 1 < len(trace):
            loop.at(trace[number + 1].arrival_s, lambda: arrive(number + 1))
        if progress is not None and number % 500 == 0:
            progress(number)
        session = trace[number].session
        if session is not None:
            if session in busy_sessions:
                held_back.setdefault(session, deque()).append(number)
                return
            busy_sessions.add(session)
        submit(number)

    def submit(number: int) -> None:
        nonlocal rejected, outstanding
        traced = trace[number]
        request = SimRequest(number, traced, blocks.chains[number], session_of(traced), loop.now)
        if not engines[0].fits(traced):
            rejected += 1
            release(request)
            return
        outstanding += 1
        if hold.must_wait(traced.input_tokens, view.instances, request.chain):
            hold.hold(request, traced.input_tokens, lambda: view.instances, request.chain)
            return
        dispatch(request)

    def dispatch(request: SimRequest) -> None:
        nonlocal rejected, outstanding
        traced = request.trace
        request.uncached_estimate = traced.input_tokens
        request.instance = chosen = policy.route(request)
        instance = policy.instances_for(request)[chosen]
        instance.start(traced.input_tokens, request.uncached_estimate, request.chain)
        if not engines[chosen].enqueue(request):
            rejected += 1
            outstanding -= 1
            instance.end(traced.input_tokens, request.uncached_estimate, admitted=False, chain=request.chain)
            policy.refused(request)
            release(request)
            release_held()

    def every(interval: float, action: Callable[[], None]) -> None:
        """Do action from the first arrival on, every interval, while requests are to come or in flight."""

        def tick() -> None:
            action()
            if outstanding or held_back or loop.now < trace[-1].arrival_s:
                loop.at(loop.now + interval, tick)

        loop.at(trace[0].arrival_s, tick)

    if trace:
        loop.at(trace[0].arrival_s, lambda: arrive(0))
        if policy.scrape_interval_s is not None:
            every(policy.scrape_interval_s, view.scrape)
        if policy.sync_interval_s is not None:
            every(policy.sync_interval_s, policy.sync)
    loop.run()
    return _result(policy.name, done, rejected, engines, ideal_hit_rate, fleet, time.perf_counter() - started)


def _result(
    name: str,
    done: list[SimRequest],
    rejected: int,
    engines: list[Engine],
    ideal_hit_rate: float,
    fleet: FleetSpec,
    wall_s: float,
) -> RunResult:
    size = fleet.engine.block_size
    ttft = np.array([r.first_token_s - r.sent_s for r in done]) if done else np.zeros(1)
    e2e = np.array([r.finish_s - r.sent_s for r in done]) if done else np.zeros(1)
    prompt = sum(r.trace.input_tokens for r in done) or 1
    busy = np.array([e.busy_s for e in engines])
    start = min((r.sent_s for r in done), default=0.0)
    end = max((r.finish_s for r in done), default=0.0)
    span = max(end - start, 1e-9)
    per_instance = [0] * len(engines)
    for request in done:
        per_instance[request.instance] += 1
    return RunResult(
        policy=name,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        e2e_p50_s=float(np.percentile(e2e, 50)),
        e2e_p99_s=float(np.percentile(e2e, 99)),
        throughput_rps=len(done) / span,
        local_hit_rate=sum(r.local_hit_blocks for r in done) * size / prompt,
        pool_hit_rate=sum(r.pool_hit_blocks for r in done) * size / prompt,
        ideal_hit_rate=ideal_hit_rate,
        load_imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        rejected=rejected,
        completed=len(done),
        utilization=float(busy.mean() / span),
        requests_per_instance=per_instance,
        busy_per_instance_s=busy.tolist(),
        longest_session_s=longest_session_active(done),
        tail=tail_of(done, fleet),
        wall_s=wall_s,
    )


def longest_session_active(done: list[SimRequest]) -> float:
    """The longest time one session had a turn in flight (its turns' send-to-finish intervals, merged). An
    instance that serves a session from start to end is busy about this long (less any time its turns wait
    before a step takes them), so for a policy that never moves a session the instance with the longest one
    sets about the busy time that load imbalance divides."""
    turns: dict[str, list[tuple[float, float]]] = {}
    for request in done:
        if request.session is not None:
            turns.setdefault(request.session, []).append((request.sent_s, request.finish_s))
    longest = 0.0
    for intervals in turns.values():
        intervals.sort()
        active, (start, end) = 0.0, intervals[0]
        for sent, finished in intervals[1:]:
            if sent > end:
                active, start = active + end - start, sent
            end = max(end, finished)
        longest = max(longest, active + end - start)
    return longest


def tail_of(done: list[SimRequest], fleet: FleetSpec) -> dict[str, float]:
    """The slowest 1% of TTFTs, decomposed (means, seconds): waiting to be admitted (mostly for KV memory, in
    the router or in the engine's queue, or behind a request that waits for it; also for the step under way
    or a sequence slot), then queued (behind other prompts' prefill chunks, its own load from the pool, steps
    as long as a decode), then its own prefill; and the share of all requests that waited more than half a
    second to be admitted."""
    if not done:
        return {}
    slowest = sorted(done, key=lambda r: r.first_token_s - r.sent_s)[-max(len(done) // 100, 1) :]
    engine = fleet.engine

    def own(request: SimRequest) -> float:
        reused = (request.local_hit_blocks + request.pool_hit_blocks) * engine.block_size
        return engine.prefill_s(reused, request.trace.input_tokens - reused)

    admission = [r.admitted_s - r.sent_s for r in slowest]
    after = [r.first_token_s - r.admitted_s for r in slowest]
    prefill = [own(r) for r in slowest]
    return {
        "requests": len(slowest),
        "ttft_s": float(np.mean([r.first_token_s - r.sent_s for r in slowest])),
        "admission_wait_s": float(np.mean(admission)),
        "queued_s": float(np.mean(after) - np.mean(prefill)),
        "own_prefill_s": float(np.mean(prefill)),
        "admission_over_0_5_s_share": float(np.mean([r.admitted_s - r.sent_s > 0.5 for r in done])),
    }
