from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.simulate.results import RESULT_FIELDS, RunResult
from kvroute.simulate.suite import FULL_GRID, Cell, parse_cells, workload_trace
from kvroute.simulate.suite_report import peers_of, verdict

VERDICT_FIELDS = {
    "ttft_p50_ratio",
    "ttft_p50_peer",
    "ttft_p99_ratio",
    "ttft_p99_peer",
    "rejected",
    "peer_rejected",
    "rejected_peer",
    "hit_share_of_ideal",
    "missed",
}


def test_default_suite_is_the_base_grid_the_fast_workloads_everywhere_and_the_slow_one_axis_off() -> None:
    cells = parse_cells(None)
    assert len(cells) == len(set(cells)) == 10 + 4 * 12 - 4 + 2 * 4 + 2 * 2
    assert {c.workload for c in cells if c.instances == 32} == {
        "mooncake",
        "rag",
        "bursty",
        "chat",
        "agentic-0",
        "long-context",
    }
    assert Cell("rag", 32, 0.9, False) in cells and Cell("long-context", 16, 0.7, False) in cells
    assert Cell("long-context", 32, 0.9, True) not in cells and Cell("agentic-1", 32, 0.7, True) not in cells
    assert Cell("long-context", 16, 0.7, True) in cells and Cell("agentic-4", 16, 0.7, True) in cells
    assert Cell("tenants", 16, 0.9, True) in cells and Cell("flows", 16, 0.7, True) in cells
    assert len(parse_cells("all")) == 12 * 2 * 3 * 2


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("workload=rag", [Cell("rag", 16, 0.7, True)]),
        (
            "workload=chat-2;pool=off  load=0.5,0.9",
            [Cell("chat-2", 16, 0.5, False), Cell("chat-2", 16, 0.9, False)],
        ),
        ("workload=bursty instances=all", [Cell("bursty", 16, 0.7, True), Cell("bursty", 32, 0.7, True)]),
    ],
)
def test_cells_replace_the_base_grids_axes(spec: str, expected: list[Cell]) -> None:
    assert parse_cells(spec) == expected


@pytest.mark.parametrize(
    "spec", ["workload=nope", "load=x", "pool=maybe", "instances=0", "size=3", "rag", "workload=mooncake-1"]
)
def test_bad_cells_are_named(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_cells(spec)


def test_every_workload_of_the_full_grid_builds() -> None:
    for name in FULL_GRID["workload"]:
        assert len(workload_trace(name, 20).requests) == 20, name


def test_the_held_out_workloads_are_new_traffic() -> None:
    """Agent sessions whose turns mostly follow within a second, and later windows of the Mooncake trace."""
    trace = workload_trace("agent-tools-100", 2000)
    turns: dict[str | None, list[float]] = {}
    for request in trace.requests:
        turns.setdefault(request.session, []).append(request.arrival_s)
    gaps = [b - a for times in turns.values() for a, b in itertools.pairwise(times)]
    assert sum(g < 1.0 for g in gaps) / len(gaps) > 0.8
    first, second = workload_trace("mooncake", 200), workload_trace("mooncake-window-1", 200)
    assert len(second.requests) == 200 and second.requests[0].block_ids != first.requests[0].block_ids


def _result(policy: str, p50: float, p99: float, rejected: int, hits: float) -> RunResult:
    return RunResult(
        policy=policy,
        ttft_p50_s=p50,
        ttft_p99_s=p99,
        e2e_p50_s=0.0,
        e2e_p99_s=0.0,
        throughput_rps=1.0,
        local_hit_rate=hits,
        pool_hit_rate=0.0,
        ideal_hit_rate=0.5,
        load_imbalance=1.0,
        rejected=rejected,
        retried=0,
    )


def test_verdict_takes_the_best_peer_per_measure() -> None:
    results = [
        _result("kvroute", 1.0, 5.0, 2, 0.49),
        _result("dynamo", 0.8, 6.0, 0, 0.4),
        _result("llm-d", 2.0, 4.0, 1, 0.4),
        _result("kvroute-priors", 0.1, 0.1, 0, 0.5),
    ]
    peers = peers_of("kvroute", results)
    assert [p.policy for p in peers] == ["dynamo", "llm-d"]  # kvroute's variants are no peers
    judged = verdict(results[0], peers)
    assert judged is not None
    assert (judged.ttft_p50_peer, judged.ttft_p99_peer, judged.rejected_peer) == ("dynamo", "llm-d", "dynamo")
    assert judged.ttft_p50_ratio == pytest.approx(1.25) and judged.ttft_p99_ratio == pytest.approx(1.25)
    assert judged.hit_share_of_ideal == pytest.approx(0.98)
    assert judged.missed == ["p50", "p99", "rejected"]
    assert verdict(results[0], []) is None


def test_a_tiny_suite_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policies = ["kvroute", "dynamo", "round-robin"]
    code = main(
        [
            "bench",
            "simulate",
            "--suite-cells",
            "workload=chat,bursty",
            "--suite-requests",
            "40",
            "--policies",
            ",".join(policies),
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    document = json.loads((tmp_path / "suite.json").read_text())
    records = document["records"]
    assert len(records) == 2 * 3
    assert {(r["workload"], r["policy"]) for r in records} == {
        (w, p) for w in ("chat", "bursty") for p in policies
    }
    for record in records:
        assert set(RESULT_FIELDS) <= set(record)
        assert (record["instances"], record["load"], record["pool"], record["requests"]) == (
            16,
            0.7,
            True,
            40,
        )
        assert set(record["vs_best_peer"]) == VERDICT_FIELDS, record["policy"]
        assert record["rejected"] + record["completed"] == 40
    assert document["summary"]["cells"] == 2
    assert len(document["summary"]["meets"]) + len(document["summary"]["misses"]) == 2
    shown = capsys.readouterr().out
    for column in ("p50/best", "p99/best", "rej/best", "hit/ideal", "missed", "kvr", "dyn", "rr"):
        assert column in shown
    assert "kvroute meets all four targets" in shown


def test_suite_refuses_pd_and_bad_cells(tmp_path: Path) -> None:
    assert main(["bench", "simulate", "--suite", "--pd", "2:2", "--out", str(tmp_path)]) == 2
    assert main(["bench", "simulate", "--suite-cells", "workload=nope", "--out", str(tmp_path)]) == 2
