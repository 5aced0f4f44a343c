"""Replay a request trace over HTTP, open loop: every request is sent at its (scaled) arrival time.

Prompts are token ids synthesized per hash id, deterministic per (seed, hash id), so requests that share
leading hash ids share exactly those tokens, and a router or engine sees the trace's prefix structure.
Each hash id stands for ``block_tokens`` real tokens instead of the trace's 512, and outputs are capped,
so a trace written for large GPUs fits a small fleet (the real stack here has a 4,096-token context).
Latencies count from the scheduled arrival, so a client or router that falls behind pays for it. A turn
that runs a tool first (the programs trace, TraceRequest.tool_s) is sent once its session's previous turn
was answered and the tool ran, as an agent sends it, and no sooner than its arrival; its latencies count
from then.
A request of a flow (a tenant) names it and its objective in the headers a gateway would set; each outcome
keeps its flow, for results per flow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.agent_sessions import SessionRun, TurnOutcome, post_stream
from kvroute.simulate.workloads import skewed_flows_trace, tenants_trace
from kvroute.traces import Trace, TraceRequest, agentic_trace, load_trace, mooncake_trace
from router.dispatch.observe.routing_headers import SESSION_HEADER
from tinymodel.builder import VOCAB_SIZE

# Token ids of the tiny model's vocabulary with the special tokens (0-2) left out.
VOCABULARY = range(3, VOCAB_SIZE)

# The headers a gateway names a request's flow (its tenant) and objective in (FlowControlConfig,
# router/dispatch/wait/settings.py); a router without flow control ignores them.
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
# Requests the multi-tenant workloads are generated with when all are asked for (their own default).
TENANT_TRACE_REQUESTS = 2000


def resolve_trace(spec: str, requests: int | None = None, rate: float = 1.0) -> Trace:
    """``agentic`` (generated), ``mooncake`` (the conversation trace shipped in kvroute/data/), ``tenants``
    or ``flows`` (kvroute/simulate/workloads.py's multi-tenant workloads, seed 0) or a path.

    The tenant workloads are generated with ``requests`` requests (each flow its share of them), not cut
    from a longer trace, whose first requests would be nearly all of one flow."""
    if spec == "agentic":
        trace = agentic_trace()
    elif spec == "programs":  # the agentic sessions, each next turn after its tool call
        trace = agentic_trace(tool_calls=True, name="programs")
    elif spec == "mooncake":
        trace = mooncake_trace()
    elif spec == "tenants":
        trace = tenants_trace(0, requests or TENANT_TRACE_REQUESTS)
    elif spec == "flows":
        trace = skewed_flows_trace(0, requests or TENANT_TRACE_REQUESTS)
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(
                f"--trace {spec!r}: not agentic, programs, mooncake or a trace file, nor tenants or flows"
            )
        trace = load_trace(path)
    if requests is not None:
        trace = trace.head(requests)
    return trace.with_rate(rate)


class PromptSynth:
    """Token ids for a trace request: ``block_tokens`` ids per hash id, the last hash id cut in proportion."""

    def __init__(self, seed: int, block_tokens: int, trace_block_tokens: int) -> None:
        self._seed, self._block, self._scale = seed, block_tokens, block_tokens / trace_block_tokens
        self._blocks: dict[int, list[int]] = {}

    def prompt(self, request: TraceRequest) -> list[int]:
        count = len(request.block_ids)
        length = min(count * self._block, max((count - 1) * self._block + 1, self.length(request)))
        ids: list[int] = []
        for hash_id in request.block_ids:
            ids += self._tokens(hash_id)
        return ids[:length]

    def length(self, request: TraceRequest) -> int:
        return max(1, math.ceil(request.input_tokens * self._scale))

    def _tokens(self, hash_id: int) -> list[int]:
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rng = random.Random(f"{self._seed}:{hash_id}")
            tokens = self._blocks[hash_id] = [rng.choice(VOCABULARY) for _ in range(self._block)]
        return tokens


@dataclass(frozen=True)
class ReplayPlan:
    trace: Trace
    model: str
    seed: int = 0
    block_tokens: int = 32  # real tokens per hash id
    max_tokens: int = 16  # output tokens per request, at most
    max_prompt_tokens: int | None = None  # longer prompts are not sent (the engine would refuse them)
    time_limit_s: float = 300.0  # no request is sent later than this after the first
    request_timeout_s: float = 120.0
    max_connections: int = 256
    session_header: str = SESSION_HEADER  # set to the trace's session, when it has them
    session_prefix: str = "trace"
    headers: Mapping[str, str] = field(default_factory=dict)
    on_request: Callable[[], None] = lambda: None  # told after every request (progress bars)


@dataclass
class ReplayRun(SessionRun):
    not_sent: int = 0  # prompts over max_prompt_tokens
    past_limit: int = 0  # turns whose tool call ended past the time limit, not sent
    late_s: float = 0.0  # how far behind schedule the slowest send was (client saturation)


async def stream_completion(
    http: aiohttp.ClientSession, base_url: str, body: dict[str, Any], headers: Mapping[str, str], start: float
) -> TurnOutcome:
    """One streamed completion; TTFT runs from ``start`` to the first chunk with a choice."""
    ttft = 0.0

    def on_chunk(chunk: dict[str, Any]) -> None:
        nonlocal ttft
        if chunk.get("choices") and not ttft:
            ttft = time.perf_counter() - start

    streamed = await post_stream(http, f"{base_url}/v1/completions", body, headers, on_chunk)
    if isinstance(streamed, TurnOutcome):
        return streamed
    if not ttft:
        return TurnOutcome("failed", error="stream ended without a chunk")
    return TurnOutcome("ok", ttft, time.perf_counter() - start, streamed.prompt_tokens, streamed.instance)


def flow_headers(request: TraceRequest) -> dict[str, str]:
    """The flow and objective a request names, as a gateway would send them; none for a request without."""
    headers = {}
    if request.flow is not None:
        headers[FAIRNESS_HEADER] = request.flow
    if request.objective is not None:
        headers[OBJECTIVE_HEADER] = request.objective
    return headers


async def replay_trace(base_url: str, plan: ReplayPlan) -> ReplayRun:
    synth = PromptSynth(plan.seed, plan.block_tokens, plan.trace.block_tokens)
    run = ReplayRun()
    requests = plan.trace.requests
    origin = requests[0].arrival_s if requests else 0.0

    async def after_tool_call(
        http: aiohttp.ClientSession, request: TraceRequest, due: float, previous: asyncio.Task[None]
    ) -> None:
        await asyncio.shield(previous)  # a turn cancelled is its own; the one before it goes on
        assert request.tool_s is not None
        due = max(due, time.perf_counter() + request.tool_s)
        if due - started > plan.time_limit_s:  # its tool call ends past the replay's time
            run.past_limit += 1
            plan.on_request()
            return
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        await send(http, request, due)

    async def send(http: aiohttp.ClientSession, request: TraceRequest, due: float) -> None:
        headers = dict(plan.headers)
        if request.session is not None:
            headers[plan.session_header] = f"{plan.session_prefix}-{plan.seed}-{request.session}"
        headers.update(flow_headers(request))
        body = {
            "model": plan.model,
            "prompt": synth.prompt(request),
            "max_tokens": max(1, min(plan.max_tokens, request.output_tokens)),
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        outcome = await stream_completion(http, base_url, body, headers, due)
        run.outcomes.append(dataclasses.replace(outcome, flow=request.flow))
        plan.on_request()

    timeout = aiohttp.ClientTimeout(total=plan.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=plan.max_connections)
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        tasks: list[asyncio.Task[None]] = []
        last_turns: dict[str, asyncio.Task[None]] = {}  # by session: its turn sent last
        for request in requests:
            offset = request.arrival_s - origin
            if offset > plan.time_limit_s:
                break
            if plan.max_prompt_tokens is not None and synth.length(request) > plan.max_prompt_tokens:
                run.not_sent += 1
                plan.on_request()
                continue
            due = started + offset
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            run.late_s = max(run.late_s, time.perf_counter() - due)
            previous = last_turns.get(request.session) if request.session is not None else None
            if previous is not None and request.tool_s is not None:
                task = asyncio.create_task(after_tool_call(http, request, due, previous))
            else:
                task = asyncio.create_task(send(http, request, due))
            if request.session is not None:
                last_turns[request.session] = task
            tasks.append(task)
        await asyncio.gather(*tasks)
    run.duration_s = time.perf_counter() - started
    return run


def replayed(plan: ReplayPlan) -> list[TraceRequest]:
    """The requests the replay will go through (sent or not): those due within its time limit."""
    requests = plan.trace.requests
    origin = requests[0].arrival_s if requests else 0.0
    return [r for r in requests if r.arrival_s - origin <= plan.time_limit_s]


def replay_size(plan: ReplayPlan) -> int:
    """Requests the replay will go through (sent or not), for progress bars."""
    return len(replayed(plan))
