"""The `flow_control` section: how requests wait in the router, and leave in order (router/dispatch/wait/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from router.settings_base import Strict


class ObjectiveConfig(Strict):
    priority: int = Field(
        default=0,
        description="its band: a higher one's requests leave the router's queue first; may be negative",
    )
    max_queued: int = Field(default=1024, ge=0, description="its requests waiting at once; past it: 429")
    max_queue_s: float = Field(
        default=20.0,
        gt=0,
        description="the longest one of its requests waits in the router's queue; past it: 429 (keep it "
        "under a gateway's ext_proc message timeout)",
    )
    max_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="its requests sent and not yet answered; past it they wait. null: no limit",
    )
    tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="prompt tokens a second it may send, a second's worth in a burst; past it: 429 with "
        "Retry-After. null: no limit",
    )


class FlowLimitsConfig(Strict):
    max_queued: int | None = Field(
        default=None, ge=0, description="one flow's requests waiting at once; past it: 429. null: no limit"
    )
    max_in_flight: int | None = Field(
        default=None, ge=1, description="one flow's requests sent and not yet answered; past it they wait"
    )
    tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="prompt tokens a second one flow may send; past it: 429. null: no limit",
    )


class FlowControlConfig(Strict):
    enabled: bool = Field(
        default=True,
        description="requests wait in the router while every instance that could serve them is saturated, "
        "and leave in order (router/dispatch/wait/flow_control.py); false: each is sent on arrival",
    )
    ordering: Literal["spt", "fcfs", "edf"] = Field(
        default="spt",
        description="within a priority band: spt (the least predicted uncached work first, aged by waiting, "
        "and fair between flows by tokens), fcfs (fair between flows by requests, first come first served "
        "within each), edf (the earliest deadline, no fairness)",
    )
    aging_tokens_per_s: float = Field(
        default=100_000.0,
        gt=0,
        description="how ordering weighs work against waiting: a prompt this many tokens longer (its cost: "
        "spt's predicted uncached tokens, fcfs's 1,000 a request) waits up to a second more than a later "
        "shorter one",
    )
    flow_share_tokens_per_s: float = Field(
        default=10_000.0,
        gt=0,
        description="fairness between flows: a flow that keeps more than this many tokens a second waiting "
        "falls behind the flows that do not; flows that both do take turns by tokens",
    )
    engine_queue_s: float = Field(
        default=0.05,
        ge=0,
        description="an instance is saturated while its queued prefill would keep a new request waiting this "
        "long (predicted by its TTFT model)",
    )
    kv_usage: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="an instance is saturated while the contexts in flight there hold this share of its KV "
        "memory",
    )
    fairness_headers: list[str] = Field(
        default_factory=lambda: ["x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"],
        description="the request headers naming its flow, first found wins; without one the flow is the "
        "session (traffic.session_header, or the body's user), else the client's API key, else one default "
        "flow",
    )
    objective_headers: list[str] = Field(
        default_factory=lambda: ["x-llm-d-inference-objective", "x-gateway-inference-objective"],
        description="the request headers naming its objective; an unnamed or unknown one is `default`",
    )
    objectives: dict[str, ObjectiveConfig] = Field(
        default_factory=dict,
        description="objectives by name; `default` (priority 0 unless given here) is every other request's",
    )
    per_flow: FlowLimitsConfig = Field(default_factory=FlowLimitsConfig, description="limits on each flow")
    engine_priority: bool = Field(
        default=True,
        description="chat, completions and Responses requests carry their objective's priority to the "
        "engine as vLLM's `priority` (negated: vLLM runs the lowest first), so an engine run with "
        "`--scheduling-policy priority` serves its own queue in the objectives' order (vLLM's default fcfs "
        "ignores it); a client's own `priority` is replaced. Set whether or not flow control is enabled. "
        "false: bodies go as sent",
    )

    def objective(self, name: str | None) -> tuple[str, ObjectiveConfig]:
        """The objective a request names, as configured (an unknown name: `default`)."""
        if name is not None and name in self.objectives:
            return name, self.objectives[name]
        return "default", self.objectives.get("default") or _DEFAULT_OBJECTIVE


_DEFAULT_OBJECTIVE = ObjectiveConfig()
