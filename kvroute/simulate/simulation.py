"""One simulation, by the run its fleet and policy take: kvroute's own routers through their conductors
(kvroute/simulate/conducted_run.py), a peer's policy on an aggregated or a prefill/decode fleet
(kvroute/simulate/run.py)."""

from __future__ import annotations

from collections.abc import Callable

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.conducted_run import ConductedRun
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.policies import SimPolicy
from kvroute.simulate.results import RunResult
from kvroute.simulate.run import DisaggregatedRun, Run
from scorers.ttft_model import TTFTPriors


def simulate(
    blocks: TraceBlocks,
    fleet: FleetSpec,
    policy: SimPolicy,
    ideal_hit_rate: float,
    priors: TTFTPriors | None = None,
    progress: Callable[[int], None] | None = None,
    tie_seed: int = 0,
) -> RunResult:
    kind = run_kind(blocks, fleet, policy)
    return kind(blocks, fleet, policy, priors, progress, tie_seed).run(ideal_hit_rate)


def run_kind(blocks: TraceBlocks, fleet: FleetSpec, policy: SimPolicy) -> type[Run]:
    """kvroute's own routers (one, or several replicas) through their conductors, on any fleet, for a trace
    of token prompts (one with images keys them beyond their token ids, which a completion's prompt cannot
    carry); else the run's own steps over the policy's route()."""
    if policy.conducts and not blocks.trace.has_images:
        return ConductedRun
    return Run if fleet.pd is None else DisaggregatedRun
