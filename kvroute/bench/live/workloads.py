"""What ``kvroute bench live`` replays through each target: generated agent sessions, or a request trace.

Both run against a base URL with the target's own seed (its own content, so no target is served from a
cache another one warmed) and tell a progress callback after every request.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvroute.agent_apis import PATHS, Api
from kvroute.agent_sessions import SessionPlan, SessionRun, run_sessions
from kvroute.trace_replay import ReplayPlan, replay_size, replay_trace, replayed
from kvroute.workload import AgentWorkload


class LiveWorkload(Protocol):
    @property
    def size(self) -> int:
        """Requests per target, at most."""

    @property
    def title(self) -> str: ...

    def describe(self) -> dict[str, Any]: ...

    async def run(self, url: str, seed: int, label: str, progress: Callable[[], None]) -> SessionRun: ...


@dataclass(frozen=True)
class SessionWorkload:
    workload: AgentWorkload
    model: str
    concurrency: int
    time_limit_s: float
    request_timeout_s: float
    api: Api = "chat"
    responses_chain: bool = False  # responses: previous_response_id chains, not the whole history

    @property
    def size(self) -> int:
        return self.workload.requests

    @property
    def title(self) -> str:
        w = self.workload
        title = f"{w.sessions} agent sessions x {w.turns} turns, concurrency {self.concurrency}"
        if self.api != "chat":
            title += f", {PATHS[self.api]}"
        return title + (" chained by previous_response_id" if self.responses_chain else "")

    def describe(self) -> dict[str, Any]:
        w = self.workload
        return {
            "mode": "sessions",
            "api": self.api,
            "responses_chain": self.responses_chain,
            "sessions": w.sessions,
            "turns": w.turns,
            "concurrency": self.concurrency,
            "system_prompt_words": w.system_prompt_words,
            "turn_words": [w.min_turn_words, w.max_turn_words],
            "max_tokens": w.max_tokens,
            "time_limit_s": self.time_limit_s,
        }

    async def run(self, url: str, seed: int, label: str, progress: Callable[[], None]) -> SessionRun:
        plan = SessionPlan(
            dataclasses.replace(self.workload, seed=seed),
            self.model,
            concurrency=self.concurrency,
            time_limit_s=self.time_limit_s,
            request_timeout_s=self.request_timeout_s,
            session_prefix=label,
            on_turn=progress,
            api=self.api,
            responses_chain=self.responses_chain,
        )
        return await run_sessions(url, plan)


@dataclass(frozen=True)
class TraceWorkload:
    plan: ReplayPlan
    rate: float  # the multiplier already applied to the trace's arrival times

    @property
    def size(self) -> int:
        return replay_size(self.plan)

    @property
    def title(self) -> str:
        p = self.plan
        return (
            f"trace {p.trace.name}: {self.size} requests at x{self.rate:g} its rate, open loop, "
            f"{p.block_tokens} tokens per hash id, <= {p.max_tokens} output tokens"
        )

    def describe(self) -> dict[str, Any]:
        p = self.plan
        requests = p.trace.requests
        return {
            "mode": "trace",
            "trace": p.trace.name,
            "requests": self.size,
            "rate": self.rate,
            "trace_span_s": requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0,
            "sessions": len({r.session for r in requests if r.session is not None}),
            "flows": dict(sorted(Counter(r.flow for r in replayed(p) if r.flow is not None).items())),
            "trace_block_tokens": p.trace.block_tokens,
            "block_tokens": p.block_tokens,
            "max_tokens": p.max_tokens,
            "max_prompt_tokens": p.max_prompt_tokens,
            "time_limit_s": p.time_limit_s,
        }

    async def run(self, url: str, seed: int, label: str, progress: Callable[[], None]) -> SessionRun:
        plan = dataclasses.replace(self.plan, seed=seed, session_prefix=label, on_request=progress)
        return await replay_trace(url, plan)
