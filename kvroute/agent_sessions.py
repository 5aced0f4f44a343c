"""Drive multi-turn agent sessions through any OpenAI-compatible endpoint and time every turn.

Each session resends its whole history every turn (system prompt, tool outputs, the assistant's replies),
streamed, so TTFT is what the engine's prefix cache and the router's placement decide. Sessions run at most
``concurrency`` at a time; no turn starts after the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec

from kvroute.workload import AgentWorkload
from router.dispatch.routing_headers import INSTANCE_HEADER, SESSION_HEADER

Status = Literal["ok", "failed", "rejected"]

# A router that sheds load answers these before any work is done: counted apart from failures, as a
# router that refuses requests under load must not look faster for it.
REJECT_STATUSES = frozenset({429, 503})


@dataclass(frozen=True)
class TurnOutcome:
    status: Status
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    instance: str = ""
    error: str = ""


@dataclass(frozen=True)
class SessionPlan:
    workload: AgentWorkload
    model: str
    concurrency: int = 8
    time_limit_s: float = 300.0
    request_timeout_s: float = 120.0
    session_prefix: str = "bench"
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with every turn, e.g. a forced policy
    on_turn: Callable[[], None] = lambda: None  # told after every turn (progress bars)


@dataclass
class SessionRun:
    outcomes: list[TurnOutcome] = field(default_factory=list)
    duration_s: float = 0.0


_chunk_decoder = msgspec.json.Decoder()


@dataclass(frozen=True)
class Streamed:
    instance: str  # the router's x-kvroute-instance, if any
    prompt_tokens: int  # from the stream's usage chunk, if it had one


async def post_stream(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: Mapping[str, str],
    on_chunk: Callable[[dict[str, Any]], None],
) -> Streamed | TurnOutcome:
    """POST a streamed request and hand every SSE data chunk to on_chunk; a failure (an HTTP error, an
    error event, a broken connection) comes back as its TurnOutcome."""
    prompt_tokens = 0
    try:
        async with http.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                detail = (await response.text())[:200]
                status: Status = "rejected" if response.status in REJECT_STATUSES else "failed"
                return TurnOutcome(status, error=f"HTTP {response.status}: {detail}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = _chunk_decoder.decode(line[6:])
                if "error" in chunk:
                    return TurnOutcome("failed", error=str(chunk["error"].get("message")))
                usage = chunk.get("usage")
                if usage:
                    prompt_tokens = int(usage.get("prompt_tokens") or 0)
                on_chunk(chunk)
            return Streamed(response.headers.get(INSTANCE_HEADER, ""), prompt_tokens)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return TurnOutcome("failed", error=type(exc).__name__)
    except msgspec.DecodeError:
        return TurnOutcome("failed", error="malformed SSE chunk")


async def stream_chat(
    http: aiohttp.ClientSession, base_url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[TurnOutcome, str]:
    """One streamed chat completion: TTFT is the time to the first chunk carrying content."""
    started = time.perf_counter()
    first_chunk = first_content = 0.0
    text: list[str] = []

    def on_chunk(chunk: dict[str, Any]) -> None:
        nonlocal first_chunk, first_content
        for choice in chunk.get("choices") or ():
            now = time.perf_counter() - started
            first_chunk = first_chunk or now
            content = (choice.get("delta") or {}).get("content") or ""
            if content:
                first_content = first_content or now
                text.append(content)

    streamed = await post_stream(http, f"{base_url}/v1/chat/completions", body, headers, on_chunk)
    if isinstance(streamed, TurnOutcome):
        return streamed, ""
    ttft = first_content or first_chunk  # a reply of tokens that decode to nothing still has a first chunk
    if not ttft:
        return TurnOutcome("failed", error="stream ended without a chunk"), ""
    e2e = time.perf_counter() - started
    return TurnOutcome("ok", ttft, e2e, streamed.prompt_tokens, streamed.instance), "".join(text)


def session_key(prefix: str, seed: int, index: int) -> str:
    """The session key run_sessions sends for session index of a workload seeded seed."""
    return f"{prefix}-{seed}-{index}"


async def run_sessions(base_url: str, plan: SessionPlan) -> SessionRun:
    workload = plan.workload
    run = SessionRun()
    slots = asyncio.Semaphore(plan.concurrency)
    started = time.perf_counter()
    deadline = started + plan.time_limit_s

    async def session(http: aiohttp.ClientSession, index: int) -> None:
        async with slots:
            messages = [{"role": "system", "content": workload.system_prompt()}]
            headers = {**plan.headers, SESSION_HEADER: session_key(plan.session_prefix, workload.seed, index)}
            for turn in range(workload.turns):
                if time.perf_counter() >= deadline:
                    return
                messages.append({"role": "user", "content": workload.user_message(index, turn)})
                body = {
                    "model": plan.model,
                    "messages": messages,
                    "max_tokens": workload.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                outcome, reply = await stream_chat(http, base_url, body, headers)
                run.outcomes.append(outcome)
                plan.on_turn()
                messages.append({"role": "assistant", "content": reply})
                await asyncio.sleep(workload.think_time(index, turn))

    timeout = aiohttp.ClientTimeout(total=plan.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=plan.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.gather(*(session(http, i) for i in range(workload.sessions)))
    run.duration_s = time.perf_counter() - started
    return run
