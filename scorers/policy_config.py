"""A policy's configuration: its scorers, their weights and parameters, and its picker; each plugin's type
and parameters checked against the registry, with the key path of what is wrong."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scorers.params import Registration
from scorers.registry import PICKERS, SCORERS, validate_params


class _Strict(BaseModel):
    # As the router's configuration: an .inf weight is a typo, and inf * 0 = nan breaks scoring.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _check_plugin(
    kind: str, registry: Mapping[str, Registration[Any]], name: str, params: dict[str, Any]
) -> None:
    if name not in registry:
        raise ValueError(f"unknown {kind} type {name!r}; known: {', '.join(sorted(registry))}")
    validate_params(registry[name].params, params)


class ScorerSpec(_Strict):
    type: str = Field(description="the scorer (see Scorers and pickers)")
    weight: float = Field(default=1.0, ge=0.0, description="its score's weight in the policy's total")
    params: dict[str, Any] = Field(default_factory=dict, description="the scorer's parameters")

    @model_validator(mode="after")
    def _known_type(self) -> ScorerSpec:
        _check_plugin("scorer", SCORERS, self.type, self.params)
        return self


class PickerSpec(_Strict):
    type: str = Field(default="max-score", description="how the totals choose an instance")
    params: dict[str, Any] = Field(default_factory=dict, description="the picker's parameters")

    @model_validator(mode="after")
    def _known_type(self) -> PickerSpec:
        _check_plugin("picker", PICKERS, self.type, self.params)
        return self


class PolicyConfig(_Strict):
    scorers: list[ScorerSpec] = Field(min_length=1, description="weighed scores of each candidate instance")
    picker: PickerSpec = Field(default_factory=PickerSpec, description="chooses by the weighed total")

    @field_validator("scorers")
    @classmethod
    def _some_weight(cls, scorers: list[ScorerSpec]) -> list[ScorerSpec]:
        # All at 0, every total is 0 and the picker draws at random: surely not what was meant.
        if all(spec.weight == 0 for spec in scorers):
            raise ValueError("every weight is 0")
        return scorers


def builtin_policies() -> dict[str, PolicyConfig]:
    return {
        "round-robin": PolicyConfig(scorers=[ScorerSpec(type="round-robin")]),
        "least-loaded": PolicyConfig(scorers=[ScorerSpec(type="inflight-load")]),
        # llm-d's precise prefix-cache profile, with its default weights
        "precise-prefix": PolicyConfig(
            scorers=[
                ScorerSpec(type="precise-prefix", weight=2.0),
                ScorerSpec(type="kv-usage", weight=1.0),
                ScorerSpec(type="queue-depth", weight=1.0),
            ]
        ),
        # the default: each instance's predicted time to first token, prefix, pool and queue in seconds;
        # affinity is hysteresis: a session moves when staying scores under half the fastest (about twice its
        # TTFT, past the scorer's resolution), so near-ties do not scatter its cache over the fleet. In-flight
        # load settles what predictions cannot tell apart (new sessions, short prompts): fewer requests there
        # means a smaller decode batch and room for the next burst (docs/bench-simulate.md measures 0.3);
        # what still ties goes where the fewest requests went lately and the most KV memory is free. Each cost
        # also counts half the wait the request would cause those arriving behind it, from the arrival rate
        # measured (at most half its own TTFT): nothing on an idle fleet, and under load a prefix computed
        # again elsewhere costs its queue (docs/notes/simulate-investigations.md, "The suite"). A request
        # that starts an agent program (or comes back after its working set lapsed) goes where the programs'
        # working sets leave the most KV room, so that it evicts no context a program in a tool call comes
        # back for (docs/benchmarks.md, "Agent programs"; weights 0.3, 1 and 4 measured worse than 2)
        "kvroute": PolicyConfig(
            scorers=[
                ScorerSpec(type="ttft-cost", weight=1.0, params={"wait_caused": 0.5}),
                ScorerSpec(type="session-affinity", weight=0.5),
                ScorerSpec(type="inflight-load", weight=0.3),
                ScorerSpec(type="spread", weight=0.1),
                ScorerSpec(type="program-room", weight=2.0),
            ]
        ),
        # prefix and load weighed in tokens; a session moves only when staying costs over twice the best
        # alternative (affinity 0.5 against cost ratios); the engines' own queues break near-ties
        "token-cost": PolicyConfig(
            scorers=[
                ScorerSpec(type="token-cost", weight=1.0),
                ScorerSpec(type="session-affinity", weight=0.5),
                ScorerSpec(type="queue-depth", weight=0.2),
            ]
        ),
    }
