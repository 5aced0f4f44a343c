"""The one explicit map from a YAML `type` to a scorer or picker."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from scorers import (
    inflight_load,
    kv_usage,
    pickers,
    precise_prefix,
    program_room,
    queue_depth,
    round_robin,
    session_affinity,
    spread,
    token_cost,
    ttft_cost,
)
from scorers.config_keys import suggested
from scorers.params import Params, Registration
from scorers.plugins import Picker, Scorer

SCORERS: dict[str, Registration[Scorer]] = {
    "round-robin": round_robin.REGISTRATION,
    "inflight-load": inflight_load.REGISTRATION,
    "queue-depth": queue_depth.REGISTRATION,
    "kv-usage": kv_usage.REGISTRATION,
    "session-affinity": session_affinity.REGISTRATION,
    "precise-prefix": precise_prefix.REGISTRATION,
    "token-cost": token_cost.REGISTRATION,
    "ttft-cost": ttft_cost.REGISTRATION,
    "spread": spread.REGISTRATION,
    "program-room": program_room.REGISTRATION,
}

PICKERS: dict[str, Registration[Picker]] = {
    "max-score": pickers.MAX_SCORE,
    "softmax": pickers.SOFTMAX,
}


def validate_params(model: type[Params], raw: dict[str, Any]) -> None:
    """Raise ValueError naming each bad parameter as params.KEY."""
    try:
        model.model_validate(raw)
    except ValidationError as exc:
        problems = [
            suggested(f"params.{'.'.join(str(p) for p in error['loc'])}: {error['msg']}", model, error)
            for error in exc.errors()
        ]
        raise ValueError("; ".join(problems)) from None
