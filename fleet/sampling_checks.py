"""The sampling parameters vLLM 0.32 checks before it queues a request: its request models read them as
pydantic's lax floats (a number, a boolean or a numeric string), then SamplingParams checks their ranges.
Either failure is a 400 there, and here."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def _check_temperature(value: float) -> str | None:
    if not math.isfinite(value):
        return f"temperature must be a finite number, got {value}."
    if value < 0.0:
        return f"temperature must be non-negative, got {value}."
    return f"temperature must be in [0, 2], got {value}." if value > 2.0 else None


def _within(name: str, low: float, high: float, low_open: bool = False) -> Callable[[float], str | None]:
    shown = f"{'(' if low_open else '['}{low:g}, {high:g}]"

    def check(value: float) -> str | None:
        inside = (low < value if low_open else low <= value) and value <= high
        return None if inside else f"{name} must be in {shown}, got {value}."

    return check


def _check_repetition_penalty(value: float) -> str | None:
    if not math.isfinite(value):
        return f"repetition_penalty must be a finite number, got {value}."
    return None if value > 0.0 else f"repetition_penalty must be greater than zero, got {value}."


CHECKS: dict[str, Callable[[float], str | None]] = {
    "temperature": _check_temperature,
    "top_p": _within("top_p", 0, 1, low_open=True),
    "min_p": _within("min_p", 0, 1),
    "presence_penalty": _within("presence_penalty", -2, 2),
    "frequency_penalty": _within("frequency_penalty", -2, 2),
    "repetition_penalty": _check_repetition_penalty,
}


def lax_float(value: Any) -> float | None:
    """A float as pydantic's lax mode reads value; None when it reads none."""
    if type(value) in (bool, int, float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def sampling_error(body: dict[str, Any]) -> tuple[str, str] | None:
    """(parameter, message) of the first sampling parameter vLLM would refuse; the body's numbers are made
    floats on the way, as vLLM reads them."""
    for name, check in CHECKS.items():
        raw = body.get(name)
        if raw is None:
            continue
        value = lax_float(raw)
        if value is None:
            return name, f"{name}: Input should be a valid number"
        body[name] = value
        problem = check(value)
        if problem is not None:
            return name, problem
    return None
