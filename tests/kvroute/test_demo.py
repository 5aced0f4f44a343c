"""`kvroute demo` runs end to end and reports every policy without failures."""

from __future__ import annotations

from pathlib import Path

from kvroute.processes import start


def test_demo_reports_every_policy(tmp_path: Path) -> None:
    child = start("demo", ["demo", "--sessions", "3", "--turns", "2", "--instances", "2"], tmp_path)
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
        assert cells[1:3] == ["6", "0"], cells  # 3 sessions x 2 turns, none failed
        assert cells[3].endswith(" ms")
        assert "fleet-0" in cells[7] and "fleet-1" in cells[7]
    # The A/B: 16 sessions x 2 turns split between round robin and the default policy, and a verdict.
    ab_rows = rows_of(ab)
    assert set(ab_rows) == {"round-robin", "kvroute"}
    requests = [int(ab_rows[p].split("│")[3]) for p in ab_rows]
    assert sum(requests) == 32 and min(requests) > 0, ab
    engine_cached = [ab_rows[p].split("│")[11].strip() for p in ab_rows]  # the fleet's usage reports it
    assert all(cell.endswith("%") for cell in engine_cached), ab
    assert "verdict: not enough data yet" in ab  # 30 TTFTs per policy are needed
