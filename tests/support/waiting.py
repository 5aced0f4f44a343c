"""Waiting in a test for something another process or thread brings about."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout_s: float = 30.0, what: str = "") -> T:
    """condition's first truthy value, asked every 20 ms; past timeout_s the test fails, saying what it
    waited for."""
    value = within(condition, timeout_s)
    assert value is not None, f"not within {timeout_s:g} s: {what or 'the condition'}"
    return value


def within(condition: Callable[[], T], timeout_s: float) -> T | None:
    """condition's first truthy value within timeout_s, asked every 20 ms; None past it (no failure)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)
    return value
