"""`kvroute demo` runs end to end, reports every policy without failures, and its A/B reaches a verdict."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvroute.demo import ab as demo_ab
from kvroute.processes import start
from router.dispatch.observe.ab import MIN_SESSIONS
from router.traffic_split import TrafficSplit


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_demo_reports_every_policy(tmp_path: Path, api: str) -> None:
    """Over each API: the agents' too, whose usage (a Responses stream's response.completed, a Messages one's
    message_delta) is where the A/B reads what the engines found cached."""
    args = ["demo", "--sessions", "5", "--turns", "3", "--instances", "2", "--api", api]
    child = start("demo", args, tmp_path)
    code = child.wait(180)
    output = child.log_path.read_text()
    assert code == 0, output
    policies, ab = output.split("A/B on live traffic")

    def rows_of(text: str) -> dict[str, str]:
        return {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 5}

    rows = rows_of(policies)
    assert {"round-robin", "least-loaded"} <= set(rows)
    for policy in ("round-robin", "least-loaded"):
        cells = [cell.strip() for cell in rows[policy].split("│")[1:-1]]
        assert cells[1:3] == ["15", "0"], cells  # 5 sessions x 3 turns, none failed
        assert cells[3].endswith(" ms")
        assert "fleet-0" in cells[7] and "fleet-1" in cells[7]
    # The A/B: as many sessions as give each policy of the split enough for a verdict, and one.
    shape = re.search(r"(\d+) sessions x 3 turns, 5 at a time", ab)
    assert shape, ab
    ab_rows = rows_of(ab)
    assert set(ab_rows) == {"round-robin", "kvroute"}
    requests = [int(ab_rows[p].split("│")[3]) for p in ab_rows]
    assert sum(requests) == 3 * int(shape[1]) and min(requests) > 0, ab
    engine_cached = {p: ab_rows[p].split("│")[11].strip() for p in ab_rows}  # the fleet's usage reports it
    assert all(cell.endswith("%") for cell in engine_cached.values()), ab
    # Each session's history stays where it is cached; round robin finds it on 1 instance in 2, and finds the
    # start every prompt shares wherever it goes. Over 3 turns of the Responses API that leaves a gap of 9-10
    # points (62.1-62.4% against 70.8-71.8% in the runs that failed at 10, two of the last six full runs),
    # more over the other APIs.
    assert float(engine_cached["kvroute"][:-1]) > float(engine_cached["round-robin"][:-1]) + 5, ab
    verdict = re.search(r"verdict: (.*)", ab)
    assert verdict and not verdict[1].startswith("not enough"), ab
    meaning = " ".join(ab.split())  # the sentence wraps
    sessions = re.search(
        r"live traffic split by session \((\d+) sessions to round-robin, (\d+) to kvroute", meaning
    )
    assert sessions and min(int(sessions[1]), int(sessions[2])) >= MIN_SESSIONS, ab
    assert re.search(r"The engines found [\d.]+% of kvroute's prompt tokens already cached", meaning), ab


def test_the_ab_runs_enough_sessions_for_each_policy() -> None:
    split = TrafficSplit(demo_ab.SPLIT)
    sessions = demo_ab.sessions_for_split(split, demo_ab.SEED, 12)
    keys = [f"{demo_ab.SESSION_PREFIX}-{demo_ab.SEED}-{i}" for i in range(sessions)]
    counts = Counter(split.policy_for(key) for key in keys)
    assert min(counts.values()) == 12 and set(counts) == set(demo_ab.SPLIT)
    assert min(Counter(split.policy_for(key) for key in keys[:-1]).values()) == 11  # and no more
    assert demo_ab.sessions_per_policy(turns=2, at_least=6) == 15  # 30 TTFTs a policy
    assert demo_ab.sessions_per_policy(turns=6, at_least=6) == MIN_SESSIONS


def _report(p50s: tuple[float, float], **comparison: object) -> tuple[dict[str, Any], dict[str, Any]]:
    def policy(p50: float, engine_cached: int | None) -> dict[str, Any]:
        return {
            "ttft_ms": {"p50": p50},
            "prompt_tokens": 1000,
            "predicted_cached_tokens": 600,
            "observed_prompt_tokens": None if engine_cached is None else 1000,
            "observed_cached_tokens": engine_cached,
        }

    report = {"policies": {"round-robin": policy(p50s[0], 550), "kvroute": policy(p50s[1], 800)}}
    return report, {"baseline": "round-robin", "candidate": "kvroute", "sessions": [12, 14], **comparison}


@pytest.mark.parametrize(
    ("p50s", "comparison", "says"),
    [
        (
            (212, 150),
            {"ttft_p50_diff_ms": 62.4, "ci95_ms": [36.1, 88.3]},
            "kvroute's median time to first token is 62.4 ms below round-robin's (150 against 212 ms); the 95% "
            "confidence interval of that gap, [36.1, 88.3] ms, excludes zero",
        ),
        (
            (150, 212),
            {"ttft_p50_diff_ms": -62.4, "ci95_ms": [-88.3, -36.1]},
            "round-robin's median time to first token is 62.4 ms below kvroute's (150 against 212 ms); the 95% "
            "confidence interval of that gap, [36.1, 88.3] ms",
        ),
        (
            (212, 200),
            {"ttft_p50_diff_ms": 12.0, "ci95_ms": [-5.0, 30.0]},
            "the medians differ by 12.0 ms (kvroute 200, round-robin 212 ms) but the 95% confidence interval of the "
            "difference, [-5.0, 30.0] ms, holds zero",
        ),
        ((212, 200), {}, f"no verdict yet: each policy needs {MIN_SESSIONS} sessions"),
    ],
)
def test_the_verdict_in_words(p50s: tuple[float, float], comparison: dict[str, Any], says: str) -> None:
    sentence = demo_ab.verdict_meaning(*_report(p50s, **comparison))
    assert sentence.startswith("Measured on live traffic split by session (12 sessions to round-robin, 14 to")
    assert says in sentence
    assert sentence.endswith(
        "The engines found 80.0% of kvroute's prompt tokens already cached (the router predicted 60.0%) and "
        "55.0% of round-robin's (predicted 60.0%)."
    )
