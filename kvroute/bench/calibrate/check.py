"""The simulator with a profile against the engine it was fitted to: a fixed small trace of agent sessions
replayed to the engine and simulated on one instance, each request's time to first token compared.

Both sides send a session's turn at its trace time or when the previous answer ended, whichever is later,
and count its TTFT from then. The engine's answers are its own tokens, which the next turn's prompt does not
repeat: the simulation caches them under tokens no prompt has.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvroute.bench.calibrate.probes import Engine
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.engine import SimRequest
from kvroute.simulate.hardware import EngineSpec, FleetSpec
from kvroute.simulate.policies import SimPolicy
from kvroute.simulate.run import Run
from kvroute.trace_replay import PromptSynth
from kvroute.traces import Trace, agentic_trace

CHECK_BLOCK_TOKENS = 32  # a hash id is 32 real tokens: the CPU engine's block


def check_trace(seed: int = 7) -> Trace:
    """Six agent sessions of a few turns within a 4,096-token context, over about 20 seconds."""
    return agentic_trace(
        seed=seed,
        sessions=6,
        block_tokens=CHECK_BLOCK_TOKENS,
        span_s=10.0,
        median_turns=6,
        system_tokens=600,
        median_new_tokens=250,
        max_context_tokens=3500,
        input_output_ratio=25.0,
        median_think_s=0.5,
        min_think_s=0.05,
        max_think_s=5.0,
        name="calibration-check",
    )


async def replayed_ttfts(
    engines: Sequence[Engine], trace: Trace, route: Sequence[int], seed: int = 0
) -> list[float]:
    """Each request's TTFT on the engine route names for it (an index into engines), in trace order."""
    synth = PromptSynth(seed, CHECK_BLOCK_TOKENS, trace.block_tokens)
    ttfts = [0.0] * len(trace.requests)
    sessions: dict[str | None, list[int]] = defaultdict(list)
    for number, request in enumerate(trace.requests):
        sessions[request.session].append(number)
    origin = time.perf_counter()

    async def session(numbers: list[int]) -> None:
        for number in numbers:
            request = trace.requests[number]
            await asyncio.sleep(max(0.0, origin + request.arrival_s - time.perf_counter()))
            streamed = await engines[route[number]].stream(synth.prompt(request), request.output_tokens)
            ttfts[number] = streamed.ttft_s

    await asyncio.gather(*(session(numbers) for numbers in sessions.values()))
    return ttfts


class Following(SimPolicy):
    """Sends each request to the instance route names for it by its trace number: where the replay sent it."""

    name = "following"

    def __init__(self, route: Sequence[int]) -> None:
        self._route = route

    def route(self, request: SimRequest) -> int:
        return self._route[request.number]


def simulated_run(fleet: FleetSpec, trace: Trace, route: Sequence[int]) -> Run:
    blocks = TraceBlocks(trace, fleet.engine.block_size, answers_in_next_turn=False)
    run = Run(blocks, fleet, Following(route))
    run.run(ideal_hit_rate=blocks.ideal_hit_rate())
    return run


def simulated_ttfts(run: Run) -> list[float]:
    """Each request's simulated TTFT, in trace order."""
    return [r.first_token_s - r.sent_s for r in sorted(run.done, key=lambda r: r.number)]


def compare(real: list[float], simulated: list[float]) -> dict[str, Any]:
    errors = [abs(s - r) / r for r, s in zip(real, simulated, strict=True) if r > 0]
    return {
        "requests": len(real),
        "ttft_median_error": statistics.median(errors),
        "ttft_p90_error": float(np.percentile(errors, 90)),
        "engine_ttft_p50_s": statistics.median(real),
        "simulated_ttft_p50_s": statistics.median(simulated),
        "engine_ttft_p99_s": float(np.percentile(real, 99)),
        "simulated_ttft_p99_s": float(np.percentile(simulated, 99)),
    }


async def check(engine: Engine, spec: EngineSpec, trace: Trace) -> dict[str, Any]:
    route = [0] * len(trace.requests)
    preempted = await engine.preemptions()
    real = await replayed_ttfts([engine], trace, route)
    preempted = await engine.preemptions() - preempted
    run = simulated_run(FleetSpec(instances=1, engine=spec, pool=None), trace, route)
    return {
        **compare(real, simulated_ttfts(run)),
        "engine_preemptions": preempted,
        "simulated_preemptions": sum(e.preemptions for e in run.engines),
        "trace": trace.name,
    }
