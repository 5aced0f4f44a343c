"""Dynamo's ThunderAgent program scheduler over its KV router: programs paused at their tool calls under KV
pressure, their next turns held in the router until they are resumed; nothing held without pressure."""

from __future__ import annotations

import pytest

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.engine import Engine, SimRequest
from kvroute.simulate.hardware import EngineSpec, FleetSpec
from kvroute.simulate.peer_thunderagent import PROGRAM_IDLE_TTL_S, DynamoThunderAgent
from kvroute.simulate.peers import DynamoCost
from kvroute.simulate.policies import priors_for
from kvroute.simulate.registry import POLICIES
from kvroute.simulate.run import Run
from kvroute.simulate.view import RouterView
from kvroute.traces import Trace, TraceRequest
from tests.kvroute.simulate.event_loops import run_until

# One instance of 400 blocks of 16: a retention budget of 6,400 tokens, pausing above 6,080 down to 5,120,
# resuming below 5,440.
SMALL = EngineSpec(kv_blocks=400)


def _prompt(start: int, tokens: int) -> TraceRequest:
    return TraceRequest(0.0, tokens, 2, tuple(range(start, start + -(-tokens // 32))))


def _blocks(*requests: TraceRequest) -> TraceBlocks:
    return TraceBlocks(Trace("thunderagent", 32, requests), 16)


def _bound(policy: DynamoCost, blocks: TraceBlocks, fleet: FleetSpec) -> EventLoop:
    """policy bound to fleet's router view; the loop, at 0."""
    loop = EventLoop()
    engines = [Engine(n, fleet.engine, blocks, loop, None, 0.0) for n in range(fleet.instances)]
    policy.bind(RouterView(fleet, loop, engines, None, priors_for(fleet)))
    return loop


def test_the_registry_runs_it_beside_dynamo() -> None:
    assert type(POLICIES["dynamo+thunderagent"](FleetSpec(2, EngineSpec(), None))) is DynamoThunderAgent


def test_under_pressure_a_program_in_a_tool_call_is_paused_and_its_next_turn_held_until_resumed() -> None:
    """a (1,100 tokens once answered) and b (4,100) act while c's 700-token turn runs: 6,200 of 6,400 with
    the buffers, over 0.95. The tick pauses a, the smallest acting program (5,000 left, under 0.80); its
    next turn waits in the router while b and c leave no room for it under 0.85, and goes once b, idle for
    the TTL since 1 s, is released."""
    blocks = _blocks(_prompt(1, 1000), _prompt(100, 4000), _prompt(300, 700), _prompt(1, 1300))
    policy = DynamoThunderAgent()
    loop = _bound(policy, blocks, FleetSpec(1, SMALL, None, event_delay_s=0.01))
    sent: list[SimRequest] = []
    turns: dict[str, SimRequest] = {}
    for number, session in enumerate("abc"):
        turn = turns[session] = SimRequest(
            number, blocks.trace.requests[number], blocks.chains[number], session
        )
        assert policy.admit(turn, sent.append)
        turn.instance = policy.route(turn)
        policy.first_token(turn)
    run_until(loop, 1.0)
    for session in "ab":
        turns[session].generated = 100
        policy.finished(turns[session])
    run_until(loop, 6.0)  # the tick at 5 s
    assert policy.paused_sessions() == ["a"] and policy.replica_of("b") == 0
    next_turn = SimRequest(3, blocks.trace.requests[3], blocks.chains[3], "a", sent_s=6.0)
    assert not policy.admit(next_turn, sent.append)
    turns["c"].generated = 100
    policy.finished(turns["c"])
    run_until(loop, 1.0 + PROGRAM_IDLE_TTL_S)
    assert sent == [] and policy.paused_sessions() == ["a"]
    run_until(loop, 10.0 + PROGRAM_IDLE_TTL_S)  # b released at the tick at 605 s: a resumes there
    assert sent == [next_turn] and policy.paused_sessions() == []
    assert next_turn.queued_s == pytest.approx(PROGRAM_IDLE_TTL_S - 1.0)
    assert policy.route(next_turn) == 0


def test_a_program_runs_where_its_admission_placed_it_whatever_the_kv_routers_cost() -> None:
    """sim-0 holds a 4,000-token request without a session (sent there after sim-1 refused it): Dynamo's
    cost sends a new prompt to sim-1, ThunderAgent places the new program by its working sets alone (none
    yet: the first worker) and pins its turns there."""
    blocks = _blocks(_prompt(1, 4000), _prompt(200, 320), _prompt(300, 320))
    chosen: dict[str, list[int]] = {}
    for policy in (DynamoThunderAgent(), DynamoCost()):
        _bound(policy, blocks, FleetSpec(2, EngineSpec(), None, event_delay_s=0.01))
        other = SimRequest(0, blocks.trace.requests[0], blocks.chains[0], None, tried=frozenset({1}))
        assert policy.route(other) == 0
        chosen[policy.name] = []
        for number in (1, 2):
            turn = SimRequest(number, blocks.trace.requests[number], blocks.chains[number], "a")
            assert policy.admit(turn, lambda request: None)
            turn.instance = policy.route(turn)
            chosen[policy.name].append(turn.instance)
            policy.first_token(turn)
            policy.finished(turn)
    assert chosen == {"dynamo+thunderagent": [0, 0], "dynamo": [1, 1]}


def test_without_kv_pressure_nothing_is_held_and_each_program_stays_on_one_worker() -> None:
    """Three sessions of three turns with tool calls on a roomy fleet: every turn goes at once, each
    session's turns where its first was placed."""
    requests = tuple(
        TraceRequest(
            0.1 * s + 0.3 * turn,
            320 + 64 * turn,
            20,
            tuple(range(100 * s, 100 * s + 10 + 2 * turn)),
            f"s{s}",
            tool_s=10.0,
        )
        for turn in range(3)
        for s in range(3)
    )
    policy = DynamoThunderAgent()
    run = Run(_blocks(*requests), FleetSpec(2, EngineSpec(), None, event_delay_s=0.01), policy)
    assert run.run(ideal_hit_rate=0.0).completed == 9
    assert all(r.queued_s == 0.0 for r in run.done) and policy.paused_sessions() == []
    assert len({(r.session, r.instance) for r in run.done}) == 3  # one worker per session
