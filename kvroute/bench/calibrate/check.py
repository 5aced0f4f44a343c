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
from typing import Any

import numpy as np

from kvroute.bench.calibrate.probes import Engine
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.hardware import EngineSpec, FleetSpec
from kvroute.simulate.registry import POLICIES
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


async def replayed_ttfts(engine: Engine, trace: Trace, seed: int = 0) -> list[float]:
    """Each request's TTFT on the engine, in trace order."""
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
            streamed = await engine.stream(synth.prompt(request), request.output_tokens)
            ttfts[number] = streamed.ttft_s

    await asyncio.gather(*(session(numbers) for numbers in sessions.values()))
    return ttfts


def simulated_run(engine: EngineSpec, trace: Trace) -> Run:
    blocks = TraceBlocks(trace, engine.block_size, answers_in_next_turn=False)
    fleet = FleetSpec(instances=1, engine=engine, pool=None)
    run = Run(blocks, fleet, POLICIES["round-robin"](fleet))
    run.run(ideal_hit_rate=blocks.ideal_hit_rate())
    return run


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
    preempted = await engine.preemptions()
    real = await replayed_ttfts(engine, trace)
    preempted = await engine.preemptions() - preempted
    run = simulated_run(spec, trace)
    done = sorted(run.done, key=lambda r: r.number)
    simulated = [r.first_token_s - r.sent_s for r in done]
    return {
        **compare(real, simulated),
        "engine_preemptions": preempted,
        "simulated_preemptions": sum(e.preemptions for e in run.engines),
        "trace": trace.name,
    }
