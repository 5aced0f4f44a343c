"""vllm-router 0.1.17's session-aware variants: sticky_least_loaded, kv_aware's session affinity, and kv_aware
with program scheduling, each as its source decides."""

from __future__ import annotations

import pytest

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.engine import Engine, SimRequest
from kvroute.simulate.hardware import EngineSpec, FleetSpec
from kvroute.simulate.peer_vllm_router import (
    VllmRouterKvAwareAffinity,
    VllmRouterKvAwarePrograms,
    VllmRouterSticky,
    cache_miss_impact_s,
    fitted_acting_ttl,
)
from kvroute.simulate.peers import ConsistentHash, VllmRouterKvAware
from kvroute.simulate.policies import SimPolicy, priors_for
from kvroute.simulate.registry import POLICIES
from kvroute.simulate.run import Run
from kvroute.simulate.view import RouterView
from kvroute.traces import Trace, TraceRequest
from scorers.candidate import EngineLoad
from tests.kvroute.simulate.event_loops import run_until

PROMPT_A = tuple(range(1, 11))  # 320 tokens in blocks of 32
PROMPT_B = tuple(range(50, 60))
PROMPT_C = tuple(range(90, 100))
LONG = tuple(range(1000, 2563))  # 50,016 tokens


def _trace(*requests: TraceRequest) -> TraceBlocks:
    return TraceBlocks(Trace("vllm-router", 32, requests), 16)


def _bound(policy: SimPolicy, blocks: TraceBlocks, instances: int = 2) -> RouterView:
    """policy bound to a fleet's router view, its loop at 0, nothing running."""
    fleet = FleetSpec(instances, EngineSpec(), None, event_delay_s=0.01)
    loop = EventLoop()
    engines = [Engine(n, fleet.engine, blocks, loop, None, 0.0) for n in range(instances)]
    view = RouterView(fleet, loop, engines, None, priors_for(fleet))
    policy.bind(view)
    return view


def _request(blocks: TraceBlocks, number: int, session: str | None) -> SimRequest:
    return SimRequest(number, blocks.trace.requests[number], blocks.chains[number], session)


def test_the_registry_runs_each_variant_as_a_peer_beside_kv_aware() -> None:
    fleet = FleetSpec(2, EngineSpec(), None)
    made = {name: type(POLICIES[name](fleet)) for name in POLICIES if name.startswith("vllm-router")}
    assert made == {
        "vllm-router-kv-aware": VllmRouterKvAware,
        "vllm-router-kv-aware+affinity": VllmRouterKvAwareAffinity,
        "vllm-router-kv-aware+programs": VllmRouterKvAwarePrograms,
        "vllm-router-sticky": VllmRouterSticky,
    }


def test_sticky_keeps_each_session_where_it_began_and_gives_new_ones_the_fewest_sessions() -> None:
    blocks = _trace(TraceRequest(0.0, 320, 2, PROMPT_A))
    policy = VllmRouterSticky()
    _bound(policy, blocks)
    first = {session: policy.route(_request(blocks, 0, session)) for session in "abcd"}
    assert policy.sessions_per_worker == [2, 2]  # a and b apart; c and d each to the one with fewer
    assert first["a"] != first["b"]
    for _ in range(3):
        for session in "abcd":
            assert policy.route(_request(blocks, 0, session)) == first[session]
    assert policy.sessions_per_worker == [2, 2]  # a returning session is not counted again


def test_sticky_sends_a_request_without_a_session_to_the_fewest_sessions_unrecorded() -> None:
    blocks = _trace(TraceRequest(0.0, 320, 2, PROMPT_A), TraceRequest(0.0, 320, 2, PROMPT_B))
    policy = VllmRouterSticky()
    _bound(policy, blocks)
    taken = policy.route(_request(blocks, 0, "a"))
    assert {policy.route(_request(blocks, n, None)) for n in (0, 1)} == {1 - taken}
    assert policy.sessions_per_worker == [int(taken == 0), int(taken == 1)]


def test_sticky_forgets_a_session_idle_past_its_expiration_but_not_one_in_use() -> None:
    blocks = _trace(TraceRequest(0.0, 320, 2, PROMPT_A))
    policy = VllmRouterSticky(expiration_s=30.0, sweep_interval_s=10.0)
    view = _bound(policy, blocks)
    policy.route(_request(blocks, 0, "a"))
    view.loop.now = 20.0
    policy.route(_request(blocks, 0, "a"))  # used again: idle from 20 s on
    view.loop.now = 45.0
    policy.route(_request(blocks, 0, None))  # a sweep: idle 25 s
    assert sum(policy.sessions_per_worker) == 1
    view.loop.now = 55.0
    policy.route(_request(blocks, 0, None))  # idle 35 s
    assert sum(policy.sessions_per_worker) == 0


def test_sticky_moves_a_session_off_a_worker_that_refused_it() -> None:
    blocks = _trace(TraceRequest(0.0, 320, 2, PROMPT_A))
    policy = VllmRouterSticky()
    _bound(policy, blocks)
    first = policy.route(_request(blocks, 0, "a"))
    retry = _request(blocks, 0, "a")
    retry.tried = frozenset({first})
    moved = policy.route(retry)
    assert moved != first
    assert policy.route(_request(blocks, 0, "a")) == moved
    assert sum(policy.sessions_per_worker) == 1


def _affinity_case(ttl_s: float) -> tuple[VllmRouterKvAwareAffinity, TraceBlocks, RouterView]:
    """Session a's first request bound to sim-0 (a tie, the first worker) and finished at 0 s; a request
    without a session then holds 320 prefill tokens on sim-0 (a tie again)."""
    blocks = _trace(
        TraceRequest(0.0, 320, 2, PROMPT_A),
        TraceRequest(0.0, 320, 2, PROMPT_B),
        TraceRequest(0.0, 320, 2, PROMPT_C),
    )
    policy = VllmRouterKvAwareAffinity(ttl_s=ttl_s)
    view = _bound(policy, blocks)
    first = _request(blocks, 0, "a")
    first.instance = policy.route(first)
    assert first.instance == 0
    policy.first_token(first)
    policy.finished(first)
    assert policy.route(_request(blocks, 2, None)) == 0
    return policy, blocks, view


def test_kv_aware_affinity_keeps_a_session_on_its_worker_against_the_cost() -> None:
    """sim-0: (320 + 320) x 1 against sim-1's 320 x 1: kv_aware moves the session's new prompt, its
    binding does not."""
    policy, blocks, view = _affinity_case(ttl_s=5.0)
    view.loop.now = 4.0
    assert policy.route(_request(blocks, 1, "a")) == 0
    assert policy.route(_request(blocks, 1, "b")) == 1  # a new session goes by the cost
    assert policy.bound_worker("b") == 1


def test_kv_aware_affinity_lets_a_binding_go_once_idle_for_its_ttl() -> None:
    policy, blocks, view = _affinity_case(ttl_s=5.0)
    view.loop.now = 5.0
    assert policy.route(_request(blocks, 1, "a")) == 1
    assert policy.bound_worker("a") == 1


def test_kv_aware_affinity_counts_the_ttl_from_the_last_request_in_flight() -> None:
    policy, blocks, view = _affinity_case(ttl_s=5.0)
    view.loop.now = 4.0
    held = _request(blocks, 1, "a")
    assert policy.route(held) == 0
    view.loop.now = 100.0  # still in flight: the binding holds
    assert policy.route(_request(blocks, 1, "a")) == 0


def test_kv_aware_affinity_retries_elsewhere_without_rebinding() -> None:
    policy, blocks, _ = _affinity_case(ttl_s=5.0)
    retry = _request(blocks, 1, "a")
    retry.tried = frozenset({0})
    assert policy.route(retry) == 1
    assert policy.bound_worker("a") == 0


@pytest.mark.parametrize(
    ("intervals", "impact_s", "ttl_s"),
    [
        ([0.5] * 99, 25.0, 0.0),  # the window is not full: 0 s
        ([0.5] * 100, 25.0, 10.0),  # answers back within 0.5 s, a miss costs 25 s: the longest
        ([0.5] * 100, 0.1, 0.0),  # a miss costs less than the wait: none
        ([0.0] * 100, 25.0, 0.0),  # no positive interval to fit
    ],
)
def test_the_acting_ttl_is_fitted_to_the_intervals_between_turns(
    intervals: list[float], impact_s: float, ttl_s: float
) -> None:
    assert fitted_acting_ttl(intervals, impact_s) == pytest.approx(ttl_s)


def test_a_fitted_acting_ttl_lies_between_the_intervals_it_covers() -> None:
    """Half come back within 0.2 s, half after 30 s: keeping the place past 0.2 s wins, 10 s never pays."""
    ttl = fitted_acting_ttl([0.2] * 50 + [30.0] * 50, 5.0)
    assert 0.2 <= ttl < 10.0


def test_a_cache_miss_costs_the_calibrated_prefill_with_its_decode_impact() -> None:
    assert cache_miss_impact_s(0) == 0.0
    assert cache_miss_impact_s(1000) == pytest.approx((0.06600062 + 0.05702024 + 0.00440573) * 1.85)


def _programs(prompt_tokens: int = 50_000) -> tuple[VllmRouterKvAwarePrograms, TraceBlocks, RouterView, int]:
    blocks = _trace(*(TraceRequest(0.0, prompt_tokens, 2, LONG, "a") for _ in range(3)))
    policy = VllmRouterKvAwarePrograms()
    view = _bound(policy, blocks)
    ring = ConsistentHash()
    ring.bind(view)
    home = ring.route(_request(blocks, 0, "a"))
    return policy, blocks, view, home


def test_programs_hold_a_new_program_while_its_home_reports_a_waiting_request() -> None:
    policy, blocks, view, home = _programs()
    sent: list[SimRequest] = []
    view.instances[home].load = EngineLoad(waiting=1, running=1, kv_usage=0.5)
    first = _request(blocks, 0, "a")
    assert not policy.admit(first, sent.append)
    run_until(view.loop, 5.0)  # it ticks every second; the scraped queue stays
    assert sent == []
    view.instances[home].load = EngineLoad(waiting=0, running=1, kv_usage=0.5)
    run_until(view.loop, 6.5)
    assert sent == [first]
    assert first.queued_s == pytest.approx(5.0)  # the first tick after the scrape
    assert policy.route(first) == home


def test_programs_pause_after_each_answer_until_the_ttl_is_learned_then_keep_the_place() -> None:
    """Cold, the TTL is 0 s: the next turn waits for the home's queue. With 100 intervals of 0.5 s and a
    50,000-token prompt (a miss costs ~25 s), the program keeps its place for 10 s: its next turn goes at
    once, whatever the home's queue."""
    policy, blocks, view, home = _programs()
    sent: list[SimRequest] = []
    view.instances[home].load = EngineLoad(waiting=0, running=0, kv_usage=0.0)
    first = _request(blocks, 0, "a")
    assert not policy.admit(first, sent.append) and sent == [first]  # an empty queue: sent at once
    view.instances[home].load = EngineLoad(waiting=3, running=1, kv_usage=0.5)
    view.loop.now = 1.0
    policy.finished(first)
    second = _request(blocks, 1, "a")
    view.loop.now = 1.5
    assert not policy.admit(second, sent.append)

    policy, blocks, view, home = _programs()
    view.instances[home].load = EngineLoad(waiting=0, running=0, kv_usage=0.0)
    policy._intervals[home].extend([0.5] * 100)
    first = _request(blocks, 0, "a")
    assert not policy.admit(first, sent.append) and sent[-1] is first
    view.instances[home].load = EngineLoad(waiting=3, running=1, kv_usage=0.5)
    run_until(view.loop, 1.0)
    policy.finished(first)
    assert policy.acting_ttl_s(home, 50_000) == pytest.approx(10.0)
    run_until(view.loop, 10.9)
    second = _request(blocks, 1, "a")
    assert policy.admit(second, sent.append)  # within 10 s of its answer: at once
    run_until(view.loop, 30.0)
    policy.finished(second)
    run_until(view.loop, 41.5)  # a tick at 41 s found its TTL run out
    assert not policy.admit(_request(blocks, 2, "a"), sent.append)
    assert sent[-1] is first


def test_programs_run_every_turn_of_a_session_on_its_consistent_hash_home() -> None:
    """Three turns of a session hashed to sim-1, each a new prompt on an idle fleet: kv_aware alone puts
    each on sim-0 (a tie, the first worker); with programs they all run on the session's home."""
    fleet = FleetSpec(2, EngineSpec(), None, event_delay_s=0.01)
    probe = _trace(TraceRequest(0.0, 320, 2, PROMPT_A))
    ring = ConsistentHash()
    _bound(ring, probe)
    session = next(f"s{n}" for n in range(100) if ring.route(_request(probe, 0, f"s{n}")) == 1)
    prompts = (PROMPT_A, PROMPT_B, PROMPT_C)
    blocks = _trace(
        *(TraceRequest(5.0 * turn, 320, 2, prompt, session) for turn, prompt in enumerate(prompts))
    )
    placed = {}
    for policy in (VllmRouterKvAwarePrograms(), VllmRouterKvAware()):
        run = Run(blocks, fleet, policy)
        assert run.run(ideal_hit_rate=0.0).completed == 3
        placed[policy.name] = [r.instance for r in sorted(run.done, key=lambda r: r.number)]
    assert placed == {"vllm-router-kv-aware+programs": [1, 1, 1], "vllm-router-kv-aware": [0, 0, 0]}


def test_programs_queue_a_turn_in_the_router_while_the_home_has_a_waiting_request() -> None:
    """One instance running one request at a time: two requests without a session, of 200 answer tokens
    each (~2.4 s), leave one waiting from 0.1 s; a program's first turn at 1.5 s waits in the router until a
    scrape finds the queue empty (3 s, the first answer given at ~2.4 s) and the next tick lets it go.
    kv_aware alone sends it on at once."""
    requests = (
        TraceRequest(0.0, 320, 200, PROMPT_A),
        TraceRequest(0.1, 320, 200, PROMPT_B),
        TraceRequest(1.5, 320, 2, PROMPT_C, "a"),
    )
    fleet = FleetSpec(1, EngineSpec(max_num_seqs=1), None, event_delay_s=0.01)
    queued = {}
    for policy in (VllmRouterKvAwarePrograms(), VllmRouterKvAware()):
        run = Run(_trace(*requests), fleet, policy)
        assert run.run(ideal_hit_rate=0.0).completed == 3
        turn = next(r for r in run.done if r.session == "a")
        queued[policy.name] = turn.queued_s
        if policy.name == "vllm-router-kv-aware+programs":
            assert turn.dispatched_s >= 3.0
    assert queued == {"vllm-router-kv-aware+programs": pytest.approx(2.0), "vllm-router-kv-aware": 0.0}
