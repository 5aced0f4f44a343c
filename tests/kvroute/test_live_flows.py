"""`kvroute bench live --trace tenants|flows`: the multi-tenant workloads replayed live, reported per flow."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from rich.console import Console

from kvroute.agent_sessions import TurnOutcome
from kvroute.bench.live.run import (
    Fleet,
    FlowResult,
    LiveReport,
    TargetResult,
    find_vllm_router,
    flow_results,
    kvroute_config,
    render_tables,
)
from kvroute.processes import FleetPorts, start
from kvroute.simulate.policies import SIM_OBJECTIVES
from kvroute.trace_replay import FAIRNESS_HEADER, OBJECTIVE_HEADER, ReplayPlan, resolve_trace
from kvroute.traces import Trace, TraceRequest
from router.config import parse_config
from tests.kvroute.test_trace_replay import _Recorder, _replay


def test_resolve_trace_generates_the_tenant_workloads() -> None:
    tenants = resolve_trace("tenants", requests=200)
    flows = resolve_trace("flows", requests=40)

    assert tenants.name == "tenants-0" and len(tenants.requests) == 200
    assert (
        sum(r.flow == "interactive" for r in tenants.requests) == 40
    )  # 1 in 5, not the head of a longer one
    assert all(r.objective == r.flow for r in tenants.requests)
    assert flows.name == "flows-0" and len(flows.requests) == 40
    assert {r.flow for r in flows.requests} == {"heavy", "light"}
    assert all(r.objective is None for r in flows.requests)
    faster = resolve_trace("tenants", requests=200, rate=2.0)
    assert [r.arrival_s for r in faster.requests] == pytest.approx(
        [r.arrival_s / 2 for r in tenants.requests]
    )
    assert len(resolve_trace("flows").requests) == 2000  # --requests 0: the generator's own size


def test_replay_names_each_request_flow_and_objective() -> None:
    requests = (
        TraceRequest(0.0, 512, 4, (1,), "s", flow="interactive", objective="interactive"),
        TraceRequest(0.1, 512, 4, (2,), flow="heavy"),
        TraceRequest(0.2, 512, 4, (3,)),
    )
    recorder = _Recorder(delay_s=0.0)

    _, run = asyncio.run(_replay(recorder, ReplayPlan(Trace("t", 512, requests), "m")))

    headers = [h for _, h, _ in recorder.received]
    assert [(h.get(FAIRNESS_HEADER), h.get(OBJECTIVE_HEADER)) for h in headers] == [
        ("interactive", "interactive"),
        ("heavy", None),
        (None, None),
    ]
    assert sorted(o.flow or "" for o in run.outcomes) == ["", "heavy", "interactive"]
    assert all(o.status == "ok" for o in run.outcomes)


def test_flow_results_per_flow() -> None:
    outcomes = [
        *(TurnOutcome("ok", ttft_s=t / 1000, flow="interactive") for t in (10, 20, 30, 40)),
        TurnOutcome("rejected", error="HTTP 429", flow="batch"),
        TurnOutcome("failed", error="TimeoutError", flow="batch"),
        TurnOutcome("ok", ttft_s=0.5, flow="batch"),
        TurnOutcome("ok", ttft_s=0.1),  # no flow: in no flow's results
    ]

    results = flow_results(outcomes)

    assert list(results) == ["batch", "interactive"]
    assert results["interactive"] == FlowResult(4, 4, 0, 0, pytest.approx(30.0), pytest.approx(40.0))
    assert results["batch"] == FlowResult(3, 1, 1, 1, 500.0, 500.0)
    assert flow_results([TurnOutcome("ok", 0.1), TurnOutcome("failed")]) == {}
    assert flow_results([TurnOutcome("failed", flow="x")]) == {"x": FlowResult(1, 0, 1, 0, None, None)}


def test_kvroute_targets_get_the_simulated_objectives() -> None:
    raw = FleetPorts.allocate(2).router_config()
    config = kvroute_config(Fleet(parse_config(raw), raw), "round-robin")
    assert config["flow_control"] == {"objectives": SIM_OBJECTIVES}
    parse_config(config)  # a configuration the router accepts

    own = {**raw, "flow_control": {"ordering": "fcfs", "objectives": {"batch": {"priority": -1}}}}
    config = kvroute_config(Fleet(parse_config(own), own), "round-robin")
    assert config["flow_control"] == {
        "ordering": "fcfs",
        "objectives": {"interactive": {"priority": 10}, "batch": {"priority": -1}},  # the fleet's own win
    }


def test_the_report_has_a_table_per_flow_when_the_trace_has_flows() -> None:
    result = TargetResult("kvroute:kvroute", "kvroute", "kvroute", 1, sent=2, ok=2)
    report = LiveReport({"title": "trace flows-0"}, ["fleet-0"], [result])
    console = Console(record=True, width=200)

    console.print(render_tables(report))
    assert "per flow" not in console.export_text()

    result.flows = flow_results(
        [TurnOutcome("ok", 0.012, flow="heavy"), TurnOutcome("rejected", flow="light")]
    )
    console.print(render_tables(report))
    text = console.export_text()
    assert "per flow" in text and "heavy" in text and "light" in text and "12 ms" in text
    assert report.to_json()["targets"][0]["flows"]["light"] == {
        "requests": 1,
        "ok": 0,
        "failed": 0,
        "rejected": 1,
        "ttft_p50_ms": None,
        "ttft_p99_ms": None,
    }


def test_command_replays_the_flows_trace_per_flow(tmp_path: Path) -> None:
    """Both flows through kvroute (and vllm-router, where installed), each reported on its own."""
    has_binary = find_vllm_router(None) is not None
    targets = ["kvroute", *(["vllm-router:round_robin"] if has_binary else [])]
    out = tmp_path / "live.json"
    args = ["bench", "live", "--fleet", "2", "--trace", "flows", "--requests", "40", "--max-tokens", "4"]
    args += ["--time-limit", "30", "--targets", ",".join(targets), "--out", str(out)]
    child = start("bench-live-flows", args, tmp_path)
    code = child.wait(180)
    assert code == 0, child.log_tail()

    written = json.loads(out.read_text())
    assert written["workload"]["trace"] == "flows-0" and sum(written["workload"]["flows"].values()) == 40
    assert [t["target"] for t in written["targets"]] == [t if ":" in t else f"{t}:kvroute" for t in targets]
    for target in written["targets"]:
        flows = target["flows"]
        assert set(flows) == {"heavy", "light"}, target["target"]
        assert sum(f["requests"] for f in flows.values()) == target["sent"] == 40
        assert all(f["ok"] == f["requests"] and f["ttft_p50_ms"] is not None for f in flows.values()), (
            target["target"],
            target["errors"],
        )
        assert target["failed"] == target["rejected"] == 0
    log = child.log_path.read_text()
    assert "per flow" in log and "heavy" in log and "light" in log
