"""What came out of a run: latencies, hits, load, and where the slowest requests' time went."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvroute.simulate.engine import Engine, SimRequest
from kvroute.simulate.hardware import FleetSpec

RESULT_FIELDS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "throughput_rps",
    "local_hit_rate",
    "pool_hit_rate",
    "ideal_hit_rate",
    "load_imbalance",
    "rejected",
    "failed",
    "retried",
    "preemptions",
)


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
    retried: int  # refused by one instance, then served or refused by another (counted in rejected then)
    failed: int = 0  # answered with an error (a peer's failed prefill leg: HTTP 500)
    preemptions: int = 0  # the engines' (vllm:num_preemptions): running requests sent back to recompute
    itl_p50_s: float = 0.0  # inter-token latency: every generated token after a request's first
    itl_p99_s: float = 0.0
    tpot_p50_s: float = 0.0  # time per output token after the first, per request
    tpot_p99_s: float = 0.0
    transferred_rate: float = 0.0  # prompt tokens decode legs fetched from prefill instances / prompt tokens
    pd_paths: dict[str, int] = field(default_factory=dict)  # completed requests by path (disaggregated)
    completed: int = 0
    utilization: float = 0.0  # mean busy time / the span from the first arrival to the last finish
    requests_per_instance: list[int] = field(default_factory=list)
    busy_per_instance_s: list[float] = field(default_factory=list)
    longest_session_s: float = 0.0  # longest_session_active: about the busiest instance's time, without moves
    tail: dict[str, float] = field(default_factory=dict)  # where the slowest 1% of TTFTs went (tail_of)
    # By the trace's flow (tenant), when it names them: TTFT percentiles, and the share of the dispatches from
    # the router's queue made while two flows or more had requests waiting (flows_of).
    flows: dict[str, dict[str, float]] = field(default_factory=dict)
    # Of a trace with sessions, as agent programs (programs_of): sessions completed and their rate, and the
    # share of what a previous turn left cached that its next turn computed again
    programs: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def summary(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in RESULT_FIELDS}


def result_of(
    name: str,
    done: list[SimRequest],
    rejected: int,
    engines: list[Engine],
    ideal_hit_rate: float,
    fleet: FleetSpec,
    wall_s: float,
    failed: int = 0,
    retried: int = 0,
    backlogged_dispatches: dict[str, int] | None = None,
    session_turns: Mapping[str, int] | None = None,
) -> RunResult:
    """Hits are the computing instance's: the prefill instance's for a disaggregated request."""
    size = fleet.engine.block_size
    ttft = np.array([r.first_token_s - r.sent_s for r in done]) if done else np.zeros(1)
    e2e = np.array([r.finish_s - r.sent_s for r in done]) if done else np.zeros(1)
    tpot = [
        (r.finish_s - r.first_token_s) / (r.trace.output_tokens - 1)
        for r in done
        if r.trace.output_tokens > 1
    ]
    itl = _weighted_percentiles(
        np.concatenate([np.frombuffer(e.itl_s) for e in engines]),
        np.concatenate([np.frombuffer(e.itl_tokens, dtype=np.int64) for e in engines]),
        (50, 99),
    )
    computed = [r.prefill or r for r in done]
    prompt = sum(r.trace.input_tokens for r in done) or 1
    busy = np.array([e.busy_s for e in engines])
    start = min((r.sent_s for r in done), default=0.0)
    end = max((r.finish_s for r in done), default=0.0)
    span = max(end - start, 1e-9)
    per_instance = [0] * len(engines)
    paths: dict[str, int] = {}
    for request in done:
        per_instance[request.instance] += 1
        if request.prefill is not None:
            per_instance[request.prefill.instance] += 1
        if request.path is not None:
            paths[request.path] = paths.get(request.path, 0) + 1
    return RunResult(
        policy=name,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        e2e_p50_s=float(np.percentile(e2e, 50)),
        e2e_p99_s=float(np.percentile(e2e, 99)),
        throughput_rps=len(done) / span,
        local_hit_rate=sum(r.local_hit_blocks for r in computed) * size / prompt,
        pool_hit_rate=sum(r.pool_hit_blocks for r in computed) * size / prompt,
        ideal_hit_rate=ideal_hit_rate,
        load_imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        rejected=rejected,
        retried=retried,
        preemptions=sum(e.preemptions for e in engines),
        failed=failed,
        itl_p50_s=itl[0],
        itl_p99_s=itl[1],
        tpot_p50_s=float(np.percentile(tpot, 50)) if tpot else 0.0,
        tpot_p99_s=float(np.percentile(tpot, 99)) if tpot else 0.0,
        transferred_rate=sum(r.transferred_tokens for r in done) / prompt,
        pd_paths=paths,
        completed=len(done),
        utilization=float(busy.mean() / span),
        requests_per_instance=per_instance,
        busy_per_instance_s=busy.tolist(),
        longest_session_s=longest_session_active(done),
        tail=tail_of(done, fleet),
        flows=flows_of(done, backlogged_dispatches or {}),
        programs=programs_of(done, size, span, session_turns or {}),
        wall_s=wall_s,
    )


def programs_of(
    done: list[SimRequest], block_size: int, span_s: float, session_turns: Mapping[str, int]
) -> dict[str, float]:
    """The sessions as agent programs: those whose every turn was answered (none refused; session_turns:
    each session's turns in the trace) and their rate an hour over the run; and, over each turn after an
    answered one of its session, the share of the previous turn's
    prompt (its whole blocks, which its instance held when the tool call began) that the turn computed
    again, having found it neither on its instance nor in the pool. Empty for a trace without sessions."""
    by_session: dict[str, list[SimRequest]] = {}
    for request in done:
        if request.session is not None:
            by_session.setdefault(request.session, []).append(request)
    if not by_session:
        return {}
    left = recomputed = next_turns = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r.number)
        for previous, turn in itertools.pairwise(turns):
            computing = turn.prefill or turn
            shared = min(previous.trace.input_tokens, turn.trace.input_tokens - 1) // block_size
            found = computing.local_hit_blocks + computing.pool_hit_blocks
            left += shared
            recomputed += max(shared - found, 0)
            next_turns += 1
    completed = sum(len(turns) == session_turns.get(session) for session, turns in by_session.items())
    return {
        "sessions_completed": completed,
        "sessions_per_hour": completed / span_s * 3600,
        "next_turns": next_turns,
        "tool_call_recompute": recomputed / left if left else 0.0,
    }


def flows_of(done: list[SimRequest], backlogged_dispatches: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per flow the trace names: requests answered, TTFT p50 and p99, and its share of the dispatches the
    router's queue made while two flows or more were waiting (absent for routers without a queue)."""
    ttfts: dict[str, list[float]] = {}
    for request in done:
        if request.trace.flow is not None:
            ttfts.setdefault(request.trace.flow, []).append(request.first_token_s - request.sent_s)
    total = sum(backlogged_dispatches.values())
    flows: dict[str, dict[str, float]] = {}
    for flow, values in sorted(ttfts.items()):
        flows[flow] = {
            "requests": len(values),
            "ttft_p50_s": float(np.percentile(values, 50)),
            "ttft_p99_s": float(np.percentile(values, 99)),
        }
        if total:
            flows[flow]["backlogged_dispatch_share"] = backlogged_dispatches.get(flow, 0) / total
    return flows


def _weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """Percentiles of values each counted weights times (the lower value at a boundary)."""
    if not len(values) or not weights.sum():
        return [0.0] * len(qs)
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    total = cumulative[-1]
    return [float(values[order][np.searchsorted(cumulative, q / 100 * total)]) for q in qs]


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
    second to be admitted. A disaggregated request's are its prefill leg's: queued then also covers the
    transfer and its decode leg's wait for the first token."""
    if not done:
        return {}
    slowest = sorted(done, key=lambda r: r.first_token_s - r.sent_s)[-max(len(done) // 100, 1) :]
    engine = fleet.engine

    def own(request: SimRequest) -> float:
        reused = (request.local_hit_blocks + request.pool_hit_blocks) * engine.block_size
        return engine.prefill_s(reused, request.trace.input_tokens - reused)

    admission = [(r.prefill or r).admitted_s - r.sent_s for r in slowest]
    after = [r.first_token_s - (r.prefill or r).admitted_s for r in slowest]
    prefill = [own(r.prefill or r) for r in slowest]
    return {
        "requests": len(slowest),
        "ttft_s": float(np.mean([r.first_token_s - r.sent_s for r in slowest])),
        "admission_wait_s": float(np.mean(admission)),
        "queued_s": float(np.mean(after) - np.mean(prefill)),
        "own_prefill_s": float(np.mean(prefill)),
        "admission_over_0_5_s_share": float(
            np.mean([(r.prefill or r).admitted_s - r.sent_s > 0.5 for r in done])
        ),
    }
