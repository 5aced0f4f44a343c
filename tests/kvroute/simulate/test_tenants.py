"""Tenants in the simulator: the two-flow workloads, kvroute's queue sharing dispatches fairly between flows,
and llm-d's default admission shedding negative-priority requests."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from kvroute.simulate.bench import rate_for_load
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.registry import EXTRA_POLICIES, POLICIES
from kvroute.simulate.results import RunResult
from kvroute.simulate.run import Run
from kvroute.simulate.workloads import skewed_flows_trace, tenants_trace


def test_tenants_trace_has_an_interactive_flow_and_a_batch_flood_at_four_times_its_rate() -> None:
    trace = tenants_trace(0, 500)
    flows = Counter(r.flow for r in trace.requests)
    assert flows == {"batch": 400, "interactive": 100}
    assert all(r.objective == r.flow for r in trace.requests)
    batch = [r.input_tokens for r in trace.requests if r.flow == "batch"]
    turns = [r for r in trace.requests if r.flow == "interactive"]
    assert min(batch) >= 7_000 and max(batch) <= 25_000
    assert len({r.session for r in turns}) < len(turns)  # sessions of several turns
    assert tenants_trace(0, 500) == trace


def test_skewed_flows_trace_has_one_flow_sending_four_times_the_other() -> None:
    flows = Counter(r.flow for r in skewed_flows_trace(0, 1000).requests)
    assert 3.5 < flows["heavy"] / flows["light"] < 4.5


def run(policy: str, trace_blocks: TraceBlocks, fleet: FleetSpec, load: float) -> tuple[Run, RunResult]:
    ideal = trace_blocks.ideal_hit_rate()
    rate = rate_for_load(trace_blocks, fleet, load, ideal)
    scaled = trace_blocks.with_trace(trace_blocks.trace.with_rate(rate))
    simulation = Run(scaled, fleet, {**POLICIES, **EXTRA_POLICIES}[policy](fleet))
    return simulation, simulation.run(ideal)


def test_backlogged_flows_share_kvroutes_dispatches_equally_whatever_their_rates() -> None:
    """Far overloaded (load 4: even the light flow sends more than half of what the fleet serves), both flows
    keep requests waiting in kvroute's queue: each gets about half of what leaves it while both wait, though
    one sends four times as many. Below that, the light flow never builds a backlog: it is served as it
    comes, and waits less than the heavy one."""
    fleet = FleetSpec(instances=2)
    blocks = TraceBlocks(skewed_flows_trace(0, 300), fleet.engine.block_size)
    _, result = run("kvroute", blocks, fleet, 4.0)
    shares = {flow: figures["backlogged_dispatch_share"] for flow, figures in result.flows.items()}
    assert min(shares.values()) >= 0.45, shares
    _, fair = run("kvroute", blocks, fleet, 1.5)
    _, unqueued = run("kvroute-no-queue", blocks, fleet, 1.5)
    assert all("backlogged_dispatch_share" not in f for f in unqueued.flows.values())  # nothing queued there
    assert fair.flows["light"]["ttft_p50_s"] < fair.flows["heavy"]["ttft_p50_s"] / 2
    assert fair.flows["light"]["ttft_p50_s"] < unqueued.flows["light"]["ttft_p50_s"] / 2


def test_llmd_sheds_the_batch_flow_when_saturated_and_kvroute_queues_it() -> None:
    """Overloaded, llm-d's default admission refuses the batch objective's requests (priority -10) while its
    detector reads saturation; kvroute queues them behind the interactive ones and refuses only those that
    wait past the objective's queue time."""
    fleet = FleetSpec(instances=2)
    blocks = TraceBlocks(tenants_trace(0, 200), fleet.engine.block_size)
    _, llmd = run("llm-d", blocks, fleet, 1.5)
    simulation, kvroute = run("kvroute", blocks, fleet, 1.5)
    assert llmd.rejected > 0
    assert llmd.flows["batch"]["requests"] < 160 and llmd.flows["interactive"]["requests"] == 40
    assert kvroute.flows["interactive"]["requests"] == 40
    assert set(simulation.refused_by_router) <= {"queue_timeout"}
    assert kvroute.flows["interactive"]["ttft_p99_s"] < llmd.flows["interactive"]["ttft_p99_s"]


def test_priority_engines_serve_the_interactive_flow_first_for_the_routers_that_pass_priority() -> None:
    """Engines run with vLLM's --scheduling-policy priority, at load 1.0: kvroute without its queue (the
    priority reaches the engine; the router orders nothing) and Dynamo (which passes it too) bring the
    interactive flow's p99 down; llm-d passes none, and its figures do not move."""
    blocks = TraceBlocks(tenants_trace(0, 300), FleetSpec().engine.block_size)
    p99: dict[tuple[str, str], float] = {}
    for scheduling in ("fcfs", "priority"):
        fleet = FleetSpec(instances=2, engine=replace(FleetSpec().engine, scheduling_policy=scheduling))
        for policy in ("kvroute-no-queue", "dynamo", "llm-d"):
            _, result = run(policy, blocks, fleet, 1.0)
            p99[policy, scheduling] = result.flows["interactive"]["ttft_p99_s"]
    assert p99["kvroute-no-queue", "priority"] < p99["kvroute-no-queue", "fcfs"] / 2, p99
    assert p99["dynamo", "priority"] < p99["dynamo", "fcfs"] / 2, p99
    assert p99["llm-d", "priority"] == p99["llm-d", "fcfs"]
