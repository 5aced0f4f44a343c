"""`kvroute bench overhead`: wrk against nginx through each router, the long-prompt case and streaming."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.bench.live.run import find_vllm_router
from kvroute.bench.overhead.backend import find_nginx
from kvroute.bench.overhead.envoy import find_envoy
from kvroute.bench.overhead.grid import CellResult
from kvroute.bench.overhead.long import LongResult, LongSummary
from kvroute.bench.overhead.report import ENVOY_EPP, KVROUTE, VLLM_KV, VLLM_RR, Verdict, verdicts
from kvroute.bench.overhead.streaming import StreamResult, StreamSettings, run_client, running_engine
from kvroute.bench.overhead.targets import PLAIN_PROXY, SERVE_WORKERS, parse_overhead_targets, serve_help
from kvroute.bench.overhead.wrk import Prompt, WrkResult, find_wrk


@pytest.mark.parametrize("size", [200, 2048, 16384])
@pytest.mark.parametrize("cold", [False, True])
def test_prompt_bodies_are_json_of_the_size_asked(size: int, cold: bool) -> None:
    prompt = Prompt(size, cold, "tag")
    head, tail = prompt.body_parts()
    body = json.loads(head + "12345" + tail if cold else prompt.body())
    assert body["messages"][0]["content"].startswith("tag ")
    assert abs(len(prompt.body()) + (5 if cold else 0) - size) <= 8


def test_cold_prompts_vary_at_the_start_of_the_content() -> None:
    lua = Prompt(300, True, "tag").lua()
    assert "request = function()" in lua and "head .. n .. tail" in lua
    assert "request = function()" not in Prompt(300, False, "tag").lua()


def _cell(target: str, concurrency: int, rps: float, added_p50: float | None) -> CellResult:
    return CellResult(target, concurrency, 200, "hot", requests_per_s=rps, added_p50_ms=added_p50)


def _long(target: str, first: float, later: float) -> LongSummary:
    return LongSummary(target, 10_000, None, None, first, later)


def test_verdicts_hold_only_if_every_cell_meets_the_target() -> None:
    cells = [
        _cell(KVROUTE, 1, 900, 0.6),
        _cell(VLLM_RR, 1, 3000, 0.5),
        _cell(KVROUTE, 64, 1000, None),
        _cell(VLLM_RR, 64, 10_000, None),
    ]
    long = [_long(KVROUTE, 20, 5), _long(VLLM_KV, 30, 4)]
    met = {v.name: v.met for v in verdicts(cells, long)}
    assert met == {
        "added p50 at c=1": True,
        "throughput at c=64": False,
        "long-prompt decision, turn 1": True,
        "long-prompt decision, later turns": False,
        f"streaming relayed tokens/s ({ENVOY_EPP})": None,
        f"streaming added ITL p99 ({ENVOY_EPP})": None,
    }
    assert all(v.met is None for v in verdicts([], []))


def test_the_plain_proxy_is_judged_by_the_same_targets_when_measured() -> None:
    cells = [
        _cell(KVROUTE, 64, 1000, None),
        _cell(PLAIN_PROXY, 64, 6000, None),
        _cell(VLLM_RR, 64, 10_000, None),
    ]
    met = {v.name: v.met for v in verdicts(cells, [])}
    assert met["throughput at c=64"] is False
    assert met["throughput at c=64 (python-proxy, the floor)"] is True
    assert met["added p50 at c=1 (python-proxy, the floor)"] is None  # no c=1 cell
    assert not any("python-proxy" in v.name for v in verdicts(cells[::2], []))


@pytest.mark.skipif(
    find_wrk() is None or find_nginx() is None,
    reason="needs wrk and nginx: `make bench-tools` (scripts/install_bench_tools.sh) installs them",
)
def test_a_small_run_writes_every_field(tmp_path: Path) -> None:
    has_vllm_router = find_vllm_router(None) is not None
    grid_targets = "direct,kvroute,kvroute:round-robin,python-proxy" + (
        ",vllm-router:round_robin" if has_vllm_router else ""
    )
    long_targets = "direct,kvroute" + (",vllm-router:kv_aware" if has_vllm_router else "")
    out = tmp_path / "overhead.json"
    argv = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "bench",
        "overhead",
        "--duration",
        "1",
        "--concurrency",
        "1,64",
        "--sizes",
        "200",
        "--prompts",
        "cold",
        "--targets",
        grid_targets,
        "--long-tokens",
        "2000",
        "--long-turns",
        "2",
        "--long-targets",
        long_targets,
        "--streams",
        "",
        "--out",
        str(out),
        "--plots",
        str(tmp_path),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())

    assert set(report) == {
        "settings",
        "routers",
        "cells",
        "long_prompt",
        "streaming",
        "verdicts",
        "profiles",
        "plots",
    }
    assert report["streaming"] == []  # --streams ''

    assert report["profiles"] == []  # only with --profile
    cell_fields = {f.name for f in dataclasses.fields(CellResult)}
    targets = grid_targets.split(",")
    assert len(report["cells"]) == 2 * len(targets)
    for cell in report["cells"]:
        assert set(cell) == cell_fields
        assert cell["failed"] == "" and cell["requests"] > 0 and cell["errors"] == 0, cell
        routed = cell["target"] != "direct"
        assert (cell["cpu_ms_per_1k"] is not None) == routed
        if routed:  # the kernel's part, read in the same /proc reads as the whole
            assert 0 <= cell["system_cpu_ms_per_1k"] <= cell["cpu_ms_per_1k"], cell
        assert cell["helpers_cpu_ms_per_1k"] is None  # none of these has a helper process
        assert (cell["peak_rss_mib"] is not None) == routed
        assert (cell["added_p50_ms"] is not None) == routed
        assert (cell["throughput_vs_vllm_router"] is not None) == has_vllm_router
    assert {r["target"] for r in report["routers"] if not r["skipped"]} >= {
        KVROUTE,
        "kvroute:round-robin",
        PLAIN_PROXY,
    }

    long = report["long_prompt"]
    assert set(long) == {"turns", "summary", "vllm_router_counters"}
    long_target_list = [t.label for t in parse_overhead_targets(long_targets.split(","))]
    assert len(long["turns"]) == 2 * len(long_target_list)
    for turn in long["turns"]:
        assert set(turn) == {f.name for f in dataclasses.fields(LongResult)}
        assert turn["error"] == "" and turn["latency_ms"] > 0, turn
    assert all(t["prompt_blocks"] > 0 for t in long["turns"] if t["target"] == KVROUTE)  # it did tokenize
    assert {s["target"] for s in long["summary"]} == set(long_target_list)
    for summary in long["summary"]:
        assert set(summary) == {f.name for f in dataclasses.fields(LongSummary)}
    if has_vllm_router:
        assert any("render" in key for key in long["vllm_router_counters"])

    assert [v["name"] for v in report["verdicts"]] == [
        "added p50 at c=1",
        "throughput at c=64",
        "added p50 at c=1 (python-proxy, the floor)",
        "throughput at c=64 (python-proxy, the floor)",
        "long-prompt decision, turn 1",
        "long-prompt decision, later turns",
        f"streaming relayed tokens/s ({ENVOY_EPP})",
        f"streaming added ITL p99 ({ENVOY_EPP})",
    ]
    assert all(set(v) == {f.name for f in dataclasses.fields(Verdict)} for v in report["verdicts"])
    assert report["plots"] and all(Path(p).stat().st_size > 0 for p in report["plots"])


def test_the_picker_and_the_floor_under_it_are_measured_apart_from_envoy(tmp_path: Path) -> None:
    """envoy-epp:floor: Envoy with a picker that decides nothing, on the same three streams a request;
    envoy-epp-1: the picker called from one filter, one stream a request."""
    if find_envoy() is None:
        pytest.skip("needs envoy: make bench-tools")
    out = tmp_path / "overhead.json"
    argv = [sys.executable, "-m", "kvroute.cli", "bench", "overhead", "--duration", "1", "--concurrency", "1"]
    argv += ["--sizes", "200", "--prompts", "hot", "--targets", "envoy-epp,envoy-epp:floor,envoy-epp-1:floor"]
    argv += ["--long-tokens", "", "--streams", "", "--plots", "", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cells = {cell["target"]: cell for cell in json.loads(out.read_text())["cells"]}
    assert set(cells) == {ENVOY_EPP, "envoy-epp:floor", "envoy-epp-1:floor"}
    for cell in cells.values():
        assert cell["failed"] == "" and cell["requests"] > 0 and cell["errors"] == 0, cell
        assert 0 < cell["helpers_cpu_ms_per_1k"] < cell["cpu_ms_per_1k"], cell


def test_wrk_results_count_every_kind_of_error() -> None:
    result = WrkResult(10, 1_000_000, 1, 2, 1.5, 3, connect=1, read=2, write=3, status=4, timeout=5)
    assert result.errors == 15 and result.requests_per_s == 10


def test_the_command_explains_missing_tools(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}  # neither wrk nor nginx on it
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "bench", "overhead", "--long-tokens", "", "--out", ""],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 2 and "wrk" in done.stderr and "make bench-tools" in done.stderr


def test_a_small_streaming_run_measures_every_target(tmp_path: Path) -> None:
    """Every target of the streaming case, a few short streams each (Envoy's only where envoy is installed;
    `serve --workers 2` skipped, with the reason, where serve has no such option)."""
    targets = ["direct", "kvroute"]
    if find_vllm_router(None) is not None:
        targets.append(VLLM_RR)
    if find_envoy() is not None:
        targets.append("envoy-epp")
    targets.append("kvroute-workers:2")
    out = tmp_path / "overhead.json"
    argv = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "bench",
        "overhead",
        "--targets",
        "",
        "--long-tokens",
        "",
        "--streams",
        "2,4",
        "--stream-tokens",
        "8",
        "--stream-step-ms",
        "5",
        "--duration",
        "1",
        "--stream-targets",
        ",".join(targets),
        "--out",
        str(out),
        "--plots",
        "",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())

    assert report["cells"] == [] and report["long_prompt"]["turns"] == []
    assert report["settings"]["streams"] == [2, 4] and report["settings"]["stream_tokens"] == 8
    skipped = {r["target"]: r["skipped"] for r in report["routers"] if r["phase"] == "streaming"}
    has_workers = "--workers" in serve_help()
    assert bool(skipped.pop("kvroute-workers:2")) != has_workers
    assert not any(skipped.values()), skipped
    measured = [t.label for t in parse_overhead_targets(targets) if has_workers or t.kind != SERVE_WORKERS]
    streams = report["streaming"]
    assert sorted((s["target"], s["concurrency"]) for s in streams) == sorted(
        (t, c) for t in measured for c in (2, 4)
    )
    for result in streams:
        assert set(result) == {f.name for f in dataclasses.fields(StreamResult)}
        assert result["tokens_per_s"] > 0 and result["ok"] > 0 and result["failed_streams"] == 0, result
        assert result["ttfb_p99_ms"] >= result["ttfb_p50_ms"] > 0
        # Tokens that reach the client in one read are 0 ms apart: on two busy cores, half of them may.
        assert result["itl_p99_ms"] > 0 and result["itl_p99_ms"] >= result["itl_p50_ms"] >= 0
        # The engine's CPU is read from /proc in clock ticks (10 ms): this short a run may take less.
        assert result["client_cores"] > 0 and result["engine_cores"] >= 0
        routed = result["target"] != "direct"
        for name in ("added_ttfb_p50_ms", "added_ttfb_p99_ms", "added_itl_p50_ms", "added_itl_p99_ms"):
            assert (result[name] is not None) == routed, (name, result)
        assert (result["router_cores"] is not None) == routed
        assert (result["peak_rss_mib"] is not None) == routed
    names = [v["name"] for v in report["verdicts"]]
    assert names[-2:] == [
        f"streaming relayed tokens/s ({ENVOY_EPP})",
        f"streaming added ITL p99 ({ENVOY_EPP})",
    ]


def test_the_stream_engine_streams_what_was_asked(tmp_path: Path) -> None:
    with running_engine(StreamSettings(tokens=3, step_ms=1), tmp_path) as (_, ports):
        stats = run_client([f"http://127.0.0.1:{port}/v1/chat/completions" for port in ports], 2, 5, 1, 0.1)
    assert stats["failed"] == 0 and stats["ok"] >= 2 and stats["tokens"] == 5 * stats["ok"]


def test_streaming_verdicts_compare_envoy_with_vllm_router() -> None:
    def result(target: str, concurrency: int, tokens_per_s: float, added_itl_p99: float) -> StreamResult:
        return StreamResult(
            target, concurrency, 256, 20, tokens_per_s=tokens_per_s, added_itl_p99_ms=added_itl_p99
        )

    streams = [
        result(ENVOY_EPP, 64, 3000, 1.2),
        result(VLLM_RR, 64, 3200, 0.5),
        result(ENVOY_EPP, 256, 9000, 30.0),
        result(VLLM_RR, 256, 12_000, 4.0),
    ]
    met = {v.name: v.met for v in verdicts([], [], streams)}
    assert met[f"streaming relayed tokens/s ({ENVOY_EPP})"] is False  # 0.75x at 256
    assert met[f"streaming added ITL p99 ({ENVOY_EPP})"] is False  # 30 ms against 4 ms at 256
    met = {v.name: v.met for v in verdicts([], [], streams[:2])}
    assert met[f"streaming relayed tokens/s ({ENVOY_EPP})"] is True
    assert met[f"streaming added ITL p99 ({ENVOY_EPP})"] is True  # within 1 ms
