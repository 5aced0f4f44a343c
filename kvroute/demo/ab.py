"""The demo's A/B: how many sessions it runs, its table, and what its verdict means, in words."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from rich.table import Table

from kvroute.agent_sessions import session_key
from kvroute.workload import AgentWorkload
from router.dispatch.observe.ab import MIN_SAMPLES, MIN_SESSIONS
from router.traffic_split import TrafficSplit

SPLIT = {"round-robin": 50, "kvroute": 50}  # the baseline first: /admin/ab compares the others with it
SESSION_PREFIX = "demo-split"
SEED = 7  # other sessions than the policy runs' (seed 0)


def sessions_per_policy(turns: int, at_least: int) -> int:
    """Sessions each policy of the A/B needs for a verdict, and at least at_least."""
    return max(MIN_SESSIONS, math.ceil(MIN_SAMPLES / turns), at_least)


def sessions_for_split(split: TrafficSplit, seed: int, per_policy: int) -> int:
    """How many sessions, numbered from 0, give every policy of the split per_policy of them. The split hashes
    each session's key (as run_sessions names it) to a policy, so 50/50 is even only on average."""
    counts: Counter[str] = Counter()
    sessions = 0
    while min(counts[name] for name, weight in split.weights.items() if weight > 0) < per_policy:
        counts[split.policy_for(session_key(SESSION_PREFIX, seed, sessions))] += 1
        sessions += 1
    return sessions


def ab_table(report: dict[str, Any], workload: AgentWorkload, concurrency: int) -> Table:
    shape = f"{workload.sessions} sessions x {workload.turns} turns, {concurrency} at a time"
    table = Table(title=f"A/B on live traffic (/admin/ab): {shape}, split by session")
    for column in (
        "policy",
        "share",
        "requests",
        "errors",
        "rejected",
        "TTFT p50",
        "TTFT p95",
        "TTFT p99",
        "e2e p50",
        "predicted\ncached",
        "engine\ncached",
        "requests per instance",
    ):
        table.add_column(column)
    for name, result in report["policies"].items():
        ttft, e2e = result["ttft_ms"], result["e2e_ms"]
        table.add_row(
            name,
            f"{report['split'][name]:.0%}",
            str(result["requests"]),
            str(result["errors"]),
            str(result["rejected"]),
            _ms(ttft["p50"]),
            _ms(ttft["p95"]),
            _ms(ttft["p99"]),
            _ms(e2e["p50"]),
            _percent(predicted_hit_rate(result)),
            _percent(engine_hit_rate(result)),
            " ".join(f"{k}:{v}" for k, v in result["requests_per_instance"].items()),
        )
    return table


def predicted_hit_rate(result: dict[str, Any]) -> float:
    return float(result["predicted_cached_tokens"]) / max(float(result["prompt_tokens"]), 1.0)


def engine_hit_rate(result: dict[str, Any]) -> float | None:
    """None: no answer's usage reported its cached tokens."""
    observed = result["observed_prompt_tokens"]
    return None if not observed else float(result["observed_cached_tokens"]) / float(observed)


def verdict_meaning(report: dict[str, Any], comparison: dict[str, Any]) -> str:
    """One comparison of the report in plain words, with the hit rates behind it. The gap and its interval
    keep the report's precision (0.1 ms): the verdict rounds them before the report does."""
    baseline, candidate = comparison["baseline"], comparison["candidate"]
    sessions = comparison["sessions"]
    where = (
        f"Measured on live traffic split by session ({sessions[0]} sessions to {baseline}, {sessions[1]} to "
        f"{candidate}, sharing one fleet at the same time)"
    )
    diff = comparison.get("ttft_p50_diff_ms")
    if diff is None:
        finding = (
            f"there is no verdict yet: each policy needs {MIN_SESSIONS} sessions and {MIN_SAMPLES} TTFTs"
        )
    else:
        low, high = comparison["ci95_ms"]
        if low > 0 or high < 0:
            faster, slower = (candidate, baseline) if low > 0 else (baseline, candidate)
            low, high = (low, high) if low > 0 else (-high, -low)
            finding = (
                f"{faster}'s median time to first token is {abs(diff):.1f} ms below {slower}'s "
                f"({_median(report, faster)} against {_median(report, slower)} ms); the 95% confidence "
                f"interval of that gap, [{low:.1f}, {high:.1f}] ms, excludes zero, so it is not noise"
            )
        else:
            finding = (
                f"the medians differ by {abs(diff):.1f} ms ({candidate} {_median(report, candidate)}, "
                f"{baseline} {_median(report, baseline)} ms) but the 95% confidence interval of the "
                f"difference, [{low:.1f}, {high:.1f}] ms, holds zero: these sessions cannot tell them apart"
            )
    return f"{where}, {finding}. {_hit_rates(report, candidate, baseline)}"


def _hit_rates(report: dict[str, Any], first: str, second: str) -> str:
    results = report["policies"][first], report["policies"][second]
    engine = [engine_hit_rate(result) for result in results]
    predicted = [f"{predicted_hit_rate(result):.1%}" for result in results]
    if None in engine:
        return (
            f"The engines did not report cached tokens; the router predicted {predicted[0]} of {first}'s "
            f"prompt tokens cached and {predicted[1]} of {second}'s."
        )
    return (
        f"The engines found {engine[0]:.1%} of {first}'s prompt tokens already cached (the router predicted "
        f"{predicted[0]}) and {engine[1]:.1%} of {second}'s (predicted {predicted[1]})."
    )


def _median(report: dict[str, Any], name: str) -> str:
    p50 = report["policies"][name]["ttft_ms"]["p50"]
    return "-" if p50 is None else f"{p50:.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
