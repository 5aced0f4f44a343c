"""The `programs` section: how the router follows agent programs (router/programs/)."""

from __future__ import annotations

from pydantic import Field, model_validator

from router.settings_base import Strict


class ProgramsConfig(Strict):
    """Agent programs: the turns of one session (its key: the session header, or what the agents' bodies
    carry) and the tool calls between them. The router keeps each program's KV working set at the instance
    of its last turn (its prompt's tokens) while a turn runs and, for a time-to-live learned from the tool
    calls it observes, while the program runs a tool; and it counts, at each next turn, whether that KV was
    still there. Read at start: a reload that changes it is refused (a restart applies it)."""

    enabled: bool = Field(default=True, description="follow programs (their metrics, on the dashboard)")
    max_programs: int = Field(
        default=65_536, ge=1, description="programs followed at once; the least recently heard from go first"
    )
    idle_end_s: float = Field(
        default=1800.0, gt=0, description="a program not heard from for this long has ended and is forgotten"
    )
    ttl_prior_s: float = Field(
        default=10.0,
        gt=0,
        description="a tool call's time-to-live until enough are observed (vllm-router's program "
        "scheduling caps its own at 10 s; in its published coding-agent trace 95% of next turns came within)",
    )
    ttl_quantile: float = Field(
        default=0.9,
        gt=0,
        lt=1,
        description="the time-to-live learned: this quantile of the last 1,024 tool calls' lengths "
        "(a turn's answer to the program's next turn)",
    )
    ttl_samples: int = Field(
        default=100, ge=1, description="tool calls observed before the time-to-live is learned"
    )
    ttl_min_s: float = Field(default=1.0, ge=0, description="the learned time-to-live's floor")
    ttl_max_s: float = Field(default=120.0, gt=0, description="the learned time-to-live's ceiling")
    start_below: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="a new program (or one whose working set lapsed or was paused) waits in the router "
        "while, at every instance, the working sets alive and its prompt would pass this share of the KV "
        "cache; null: it starts at once (router/programs/admission.py). 1.0, with pause_above, for a fleet "
        "of agents whose contexts outgrow its KV",
    )
    max_wait_s: float = Field(
        default=30.0, gt=0, description="the longest a program waits for room; then it goes as if at once"
    )
    pause_above: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="an instance's working sets past this share of its KV cache pause the programs in a tool "
        "call there, the longest in it first, until they are back under pause_to: their working sets are "
        "given up, and their next turns start as programs back (Dynamo's ThunderAgent pauses at 0.95); "
        "null: none is paused",
    )
    pause_to: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="where pausing brings an instance's working sets back to (ThunderAgent's: 0.8)",
    )
    warm_up: bool = Field(
        default=False,
        description="when a program's turn is answered and its next turn is foreseen to go where its "
        "prompt's KV is not (it must move, or the working sets at its instance pass its KV cache), that "
        "instance loads the prompt from the Mooncake pool (one token's request) while the tool runs, if the "
        "pool holds it, the instance is idle and the working set fits (router/programs/warm_ups.py)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ProgramsConfig:
        if self.ttl_min_s > self.ttl_max_s:
            raise ValueError(f"ttl_min_s ({self.ttl_min_s}) is above ttl_max_s ({self.ttl_max_s})")
        if self.pause_above is not None and self.pause_to > self.pause_above:
            raise ValueError(f"pause_to ({self.pause_to}) is above pause_above ({self.pause_above})")
        return self
