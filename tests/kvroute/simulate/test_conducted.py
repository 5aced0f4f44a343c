"""kvroute's router in the simulation runs the product's conductor, on the trace's clock."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvroute.simulate.bench import rate_for_load
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.conducted_run import ConductedRun
from kvroute.simulate.hardware import POOL_PRESETS, EngineSpec, FleetSpec, PoolSpec
from kvroute.simulate.policies import ConfiguredPolicy, Replicas, router_config
from kvroute.simulate.registry import EXTRA_POLICIES, POLICIES
from kvroute.simulate.run import Run, SimulationStalled
from kvroute.simulate.simulation import run_kind
from kvroute.simulate.trace_loop import TraceLoop
from kvroute.traces import Trace, TraceRequest, agentic_trace, mooncake_trace
from router.dispatch.wait.settings import FlowLimitsConfig
from router.prompt import block_hashing


def test_the_trace_loop_wakes_coroutines_at_their_simulated_times_ready_callbacks_first() -> None:
    clock = EventLoop()
    loop = TraceLoop(clock)  # type: ignore[abstract]
    seen: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        seen.append((name, clock.now))

    async def timed_out() -> None:
        try:
            async with asyncio.timeout(5):
                await asyncio.sleep(100)
        except TimeoutError:
            seen.append(("timed out", clock.now))

    def start() -> None:
        for name in ("a", "b"):
            loop.create_task(sleeper(name, 1.0))
        loop.create_task(timed_out())
        clock.at(clock.now, lambda: seen.append(("timed", clock.now)))  # due now, but after what is ready

    clock.at(0.5, start)
    loop.run()
    # The tasks' first steps ran before the callback timed for the same moment.
    assert seen == [("timed", 0.5), ("a", 1.5), ("b", 1.5), ("timed out", 5.5)]


def test_a_simulation_run_from_a_coroutine_leaves_its_loop_running() -> None:
    async def simulate_inside() -> asyncio.AbstractEventLoop:
        TraceLoop(EventLoop()).run()  # type: ignore[abstract]
        return asyncio.get_running_loop()

    assert asyncio.run(simulate_inside()) is not None


def _programs(instances: int, sessions: int) -> tuple[TraceBlocks, FleetSpec]:
    fleet = FleetSpec(instances=instances, engine=EngineSpec(kv_blocks=2_000), pool=None)
    trace = agentic_trace(seed=0, sessions=sessions, tool_calls=True, name="programs").with_rate(4.0)
    return TraceBlocks(trace, fleet.engine.block_size), fleet


def test_a_prompt_sent_as_token_ids_keys_as_the_trace_blocks() -> None:
    blocks, _ = _programs(2, 3)
    for number in range(len(blocks.trace.requests)):
        ids = blocks.prompt_ids(number)
        assert len(ids) == blocks.trace.requests[number].input_tokens
        assert block_hashing.prompt_chain(ids, 16) == list(blocks.chains[number])


def test_kvroute_is_simulated_through_the_conductor_and_its_peers_through_their_routes() -> None:
    blocks, fleet = _programs(2, 3)
    assert run_kind(blocks, fleet, POLICIES["kvroute"](fleet)) is ConductedRun
    assert run_kind(blocks, fleet, EXTRA_POLICIES["kvroute+program-admission"](fleet)) is ConductedRun
    assert run_kind(blocks, fleet, POLICIES["llm-d"](fleet)) is Run  # kvroute's scorers, llm-d's way


def test_the_conductor_routes_a_programs_trace_as_the_policys_own_steps_do() -> None:
    # Where no request waits in the router, the product's stages decide each request as the policy's own
    # steps (ConfiguredPolicy.route) did, field for field: the same instances, the same engine timelines.
    blocks, fleet = _programs(3, 12)
    policy = EXTRA_POLICIES["kvroute+warm-up"]
    ideal = blocks.ideal_hit_rate()
    own = dataclasses.asdict(Run(blocks, fleet, policy(fleet)).run(ideal))
    conducted = dataclasses.asdict(ConductedRun(blocks, fleet, policy(fleet)).run(ideal))
    del own["wall_s"], conducted["wall_s"]
    assert conducted["completed"] + conducted["rejected"] == len(blocks.trace.requests)
    assert conducted["completed"] > 100
    assert conducted == own


def test_the_conductor_queues_and_confirms_the_pool_as_the_policys_own_steps_do() -> None:
    # The Mooncake trace at load 0.9 with the pool: requests wait in flow control and are let go as first
    # tokens free room, pool credit is confirmed; the product's stages still decide as the policy's steps did.
    fleet = FleetSpec(8, EngineSpec(), PoolSpec(load_s_per_token=POOL_PRESETS["rdma"]), event_delay_s=0.05)
    base = TraceBlocks(mooncake_trace().head(300), fleet.engine.block_size)
    ideal = base.ideal_hit_rate()
    blocks = base.with_trace(base.trace.with_rate(rate_for_load(base, fleet, 0.9, ideal)))
    policy = POLICIES["kvroute"]
    own = dataclasses.asdict(Run(blocks, fleet, policy(fleet)).run(ideal))
    conducted = dataclasses.asdict(ConductedRun(blocks, fleet, policy(fleet)).run(ideal))
    del own["wall_s"], conducted["wall_s"]
    assert conducted["tail"]["queued_s"] > 0  # some did wait in the router
    assert conducted == own


def test_replicas_of_kvroute_each_run_their_own_conductor_as_the_policys_own_steps_do() -> None:
    # Two routers sharing nothing, requests in turn: each decides on its own counts, through its own stages.
    blocks, fleet = _programs(3, 12)
    policy = POLICIES["kvroute"]
    ideal = blocks.ideal_hit_rate()

    def replicas() -> Replicas:
        return Replicas("two", lambda: policy(fleet), 2, by_session=False)

    assert run_kind(blocks, fleet, replicas()) is ConductedRun
    own = dataclasses.asdict(Run(blocks, fleet, replicas()).run(ideal))
    conducted = dataclasses.asdict(ConductedRun(blocks, fleet, replicas()).run(ideal))
    del own["wall_s"], conducted["wall_s"]
    assert conducted["completed"] > 100
    assert conducted == own


@pytest.mark.parametrize(("share_s", "most"), [(None, 2), (0.05, 1)])
def test_replicas_sharing_their_snapshots_hold_a_tenants_limit_as_one(
    share_s: float | None, most: int
) -> None:
    """Two kvroute routers in turn, each with a limit of one request in flight for the tenant: sharing
    nothing, the tenant has two in flight at once; sharing through the product's snapshots (a flow let go
    at its limit nudges one at once), one."""
    fleet = FleetSpec(instances=2, engine=EngineSpec(), pool=None)
    config = router_config(fleet)
    flows = config.flow_control.model_copy(update={"per_flow": FlowLimitsConfig(max_in_flight=1)})
    limited = config.model_copy(update={"flow_control": flows})
    turns = tuple(
        TraceRequest(0.01 * n, 320, 30, tuple(range(10 * n + 1, 10 * n + 11)), flow="t") for n in range(6)
    )
    policy = Replicas(
        "two", lambda: ConfiguredPolicy("limited", limited, "kvroute"), 2, by_session=False, share_s=share_s
    )
    run = ConductedRun(TraceBlocks(Trace("limited", 32, turns), 16), fleet, policy)
    run.run(0.0)
    assert len(run.done) == 6
    spans = [(r.dispatched_s, r.finish_s) for r in run.done]
    assert max(sum(start <= at < end for start, end in spans) for at, _ in spans) == most


def test_a_run_whose_answers_never_come_fails_rather_than_ticking_forever() -> None:
    # The engines compute, but the router never hears a last token: its requests stay outstanding, and
    # only the periodic scrapes are left to happen.
    blocks, fleet = _programs(2, 3)
    run = ConductedRun(blocks, fleet, POLICIES["kvroute"](fleet))
    for engine in run.engines:
        engine.on_finish = lambda request: None
    with pytest.raises(SimulationStalled, match="no engine answered for 600 s"):
        run.run(blocks.ideal_hit_rate())
