"""Drive multi-turn agent sessions through an endpoint and time every turn.

Each session resends its whole history every turn (system prompt, tool outputs, the assistant's replies),
streamed, so TTFT is what the engine's prefix cache and the router's placement decide. The session speaks
one API: chat completions, OpenAI Responses or Anthropic Messages (kvroute/agent_apis.py); with Responses it
can instead chain stored responses by previous_response_id. Sessions run at most ``concurrency`` at a time;
no turn starts after the deadline.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec

from kvroute.agent_apis import LAST_EVENT, PATHS, READERS, Api, History, StreamReading, request_body
from kvroute.workload import AgentWorkload
from router.dispatch.observe.routing_headers import INSTANCE_HEADER, SESSION_HEADER

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
    flow: str | None = None  # a trace replay's: the flow (tenant) the request came from


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
    api: Api = "chat"
    # responses only: each turn sends its new input after the last stored response (previous_response_id)
    responses_chain: bool = False

    def __post_init__(self) -> None:
        if self.responses_chain and self.api != "responses":
            raise ValueError("a chain of stored responses needs the responses API")


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
                detail = http_error_detail(await response.text())
                status: Status = "rejected" if response.status in REJECT_STATUSES else "failed"
                return TurnOutcome(status, error=f"HTTP {response.status}: {detail}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = _chunk_decoder.decode(line[6:])
                if "error" in chunk:  # OpenAI's error chunk, Anthropic's error event
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    return TurnOutcome("failed", error=str(message))
                usage = chunk.get("usage")
                if usage:
                    prompt_tokens = int(usage.get("prompt_tokens") or 0)
                on_chunk(chunk)
            return Streamed(response.headers.get(INSTANCE_HEADER, ""), prompt_tokens)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return TurnOutcome("failed", error=type(exc).__name__)
    except msgspec.DecodeError:
        return TurnOutcome("failed", error="malformed SSE chunk")


_RESPONSE_ID = re.compile(r"\bresp_[0-9A-Za-z_-]+")


def http_error_detail(body: str) -> str:
    """An error answer's message (OpenAI's and Anthropic's error objects both have one), else the start of
    the body; response ids masked, so that the same failure of many sessions counts as one kind."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        error = error.get("message")
    message = str(error or body)
    return _RESPONSE_ID.sub("resp_*", message[:200])


@dataclass(frozen=True)
class Reply:
    outcome: TurnOutcome
    text: str = ""
    response_id: str = ""  # responses: the id it was stored under


async def stream_turn(
    http: aiohttp.ClientSession, base_url: str, api: Api, body: dict[str, Any], headers: Mapping[str, str]
) -> Reply:
    """One streamed turn in api: TTFT is the time to the first event carrying text (to the first sign of
    output when the reply decodes to nothing); a stream cut before its API's last event failed."""
    started = time.perf_counter()
    reading = StreamReading()
    read = READERS[api]

    def on_chunk(chunk: dict[str, Any]) -> None:
        read(chunk, reading, time.perf_counter() - started)

    streamed = await post_stream(http, base_url + PATHS[api], body, headers, on_chunk)
    if isinstance(streamed, TurnOutcome):
        return Reply(streamed)
    if reading.error:
        return Reply(TurnOutcome("failed", error=reading.error))
    if not reading.finished or not reading.ttft:
        return Reply(TurnOutcome("failed", error=f"stream ended without {LAST_EVENT[api]}"))
    e2e = time.perf_counter() - started
    outcome = TurnOutcome("ok", reading.ttft, e2e, reading.prompt_tokens, streamed.instance)
    return Reply(outcome, "".join(reading.text), reading.response_id)


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
            history = History(workload.system_prompt())
            headers = {**plan.headers, SESSION_HEADER: session_key(plan.session_prefix, workload.seed, index)}
            for turn in range(workload.turns):
                if time.perf_counter() >= deadline:
                    return
                if (image := workload.image(index, turn)) is not None:
                    if plan.api != "chat":
                        raise ValueError("images are sent on chat sessions only")
                    history.images[len(history.texts)] = image
                history.texts.append(workload.user_message(index, turn))
                body = request_body(plan.api, history, plan.model, workload.max_tokens, plan.responses_chain)
                reply = await stream_turn(http, base_url, plan.api, body, headers)
                run.outcomes.append(reply.outcome)
                plan.on_turn()
                history.answered(reply.text, reply.response_id if plan.responses_chain else "")
                await asyncio.sleep(workload.think_time(index, turn))

    timeout = aiohttp.ClientTimeout(total=plan.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=plan.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.gather(*(session(http, i) for i in range(workload.sessions)))
    run.duration_s = time.perf_counter() - started
    return run
