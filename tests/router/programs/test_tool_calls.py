"""The time-to-live learned from agents' tool calls: the prior until enough are seen, then a quantile of the
latest ones, within its bounds."""

from __future__ import annotations

from router.programs.settings import ProgramsConfig
from router.programs.tool_calls import WINDOW, ToolCalls


def test_the_prior_holds_until_enough_tool_calls_are_seen() -> None:
    calls = ToolCalls(ProgramsConfig(ttl_prior_s=10, ttl_samples=100))
    for _ in range(99):
        calls.observe(0.5)
    assert calls.ttl_s == 10
    calls.observe(0.5)
    assert calls.ttl_s == 1.0  # learned: 0.5 s, raised to the floor


def test_the_time_to_live_is_the_quantile_of_the_latest_tool_calls() -> None:
    calls = ToolCalls(ProgramsConfig(ttl_quantile=0.9, ttl_samples=10, ttl_min_s=0, ttl_max_s=1000))
    for length in range(1, 101):  # 1..100 s
        calls.observe(float(length))
    assert 88 <= calls.ttl_s <= 92
    for _ in range(WINDOW):  # the workload changed: only the latest count
        calls.observe(2.0)
    assert calls.ttl_s == 2.0


def test_the_learned_time_to_live_stays_under_its_ceiling() -> None:
    calls = ToolCalls(ProgramsConfig(ttl_samples=1, ttl_max_s=30))
    for _ in range(16):
        calls.observe(600.0)
    assert calls.ttl_s == 30
