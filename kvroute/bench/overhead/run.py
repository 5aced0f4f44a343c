"""`kvroute bench overhead`: what the router itself costs per request.

Three parts, each with its own fixed backend and every router started at once in front of it:
the grid (wrk against nginx: direct vs each router, concurrency x body size x hot/cold, interleaved), the
long-prompt case (agent turns of 10K-100K tokens, where the routing decision needs the prompt's token ids) and
streaming (concurrent streamed answers from a paced engine, each chunk timed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvroute.bench.overhead.backend import find_nginx, start_nginx, start_render_backends
from kvroute.bench.overhead.defaults import GRID_TARGETS, LONG_TARGETS, STREAM_TARGETS
from kvroute.bench.overhead.grid import Cell, CellResult, grid, run_grid, warm_up
from kvroute.bench.overhead.long import LongResult, run_long, summarize, vllm_router_counters
from kvroute.bench.overhead.profiler import CellProfile, Profiler, find_py_spy
from kvroute.bench.overhead.report import (
    grid_table,
    long_table,
    plot,
    stages_table,
    streaming_table,
    verdict_table,
    verdicts,
)
from kvroute.bench.overhead.streaming import (
    StreamResult,
    StreamSettings,
    run_streaming,
    streaming_fleet,
)
from kvroute.bench.overhead.streaming import warm_up as warm_up_streams
from kvroute.bench.overhead.targets import (
    Running,
    backend_fleet,
    parse_overhead_targets,
    running_targets,
)
from kvroute.bench.overhead.wrk import find_wrk
from kvroute.processes import StartupError, free_port_block


@dataclass(frozen=True)
class OverheadOptions:
    duration_s: float = 5.0
    concurrency: tuple[int, ...] = (1, 64)
    sizes: tuple[int, ...] = (200, 2048, 16384)
    prompts: tuple[str, ...] = ("hot", "cold")
    targets: tuple[str, ...] = GRID_TARGETS
    long_tokens: tuple[int, ...] = (10_000, 50_000, 100_000)
    long_turns: int = 4
    long_targets: tuple[str, ...] = LONG_TARGETS
    streams: tuple[int, ...] = (64, 256)  # concurrent streams; () skips the streaming case
    stream: StreamSettings = field(default_factory=StreamSettings)
    stream_targets: tuple[str, ...] = STREAM_TARGETS
    vllm_router: str | None = None
    out: Path | None = Path("bench-results/overhead.json")
    plots: Path | None = Path("bench-results")  # PNGs named overhead-*.png
    log_dir: Path | None = None
    profile_dir: Path | None = None  # py-spy kvroute at the highest concurrency, raw stacks here


@dataclass
class RouterProcess:
    phase: str  # grid, long or streaming
    target: str
    skipped: str = ""
    peak_rss_mib: float | None = None


@dataclass
class OverheadReport:
    settings: dict[str, Any]
    routers: list[RouterProcess] = field(default_factory=list)
    cells: list[CellResult] = field(default_factory=list)
    long_turns: list[LongResult] = field(default_factory=list)
    vllm_router_counters: dict[str, float] = field(default_factory=dict)
    streams: list[StreamResult] = field(default_factory=list)
    profiles: list[CellProfile] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        summaries = summarize(self.long_turns)
        return {
            "settings": self.settings,
            "routers": [dataclasses.asdict(r) for r in self.routers],
            "cells": [dataclasses.asdict(c) for c in self.cells],
            "long_prompt": {
                "turns": [dataclasses.asdict(t) for t in self.long_turns],
                "summary": [dataclasses.asdict(s) for s in summaries],
                "vllm_router_counters": self.vllm_router_counters,
            },
            "streaming": [dataclasses.asdict(s) for s in self.streams],
            "verdicts": [dataclasses.asdict(v) for v in verdicts(self.cells, summaries, self.streams)],
            "profiles": [dataclasses.asdict(p) for p in self.profiles],
            "plots": self.plots,
        }


class MissingTool(Exception):
    pass


def run_overhead_bench(options: OverheadOptions, console: Console | None = None) -> OverheadReport:
    console = console or Console(width=None if Console().is_terminal else 160)
    cells = grid(options.concurrency, options.sizes, options.prompts) if options.targets else []
    wrk, nginx = find_wrk(), find_nginx()
    if cells and (wrk is None or nginx is None):
        missing = " and ".join(name for name, path in (("wrk", wrk), ("nginx", nginx)) if path is None)
        raise MissingTool(f"{missing} not found: run `make bench-tools` (or apt-get install nginx wrk)")
    grid_targets = parse_overhead_targets(options.targets)
    long_targets = parse_overhead_targets(options.long_targets) if options.long_tokens else []
    if long_targets and all(t.kind != "direct" for t in long_targets):
        raise ValueError("--long-targets needs direct: added latency is measured against it")
    stream_targets = parse_overhead_targets(options.stream_targets) if options.streams else []
    if stream_targets and all(t.kind != "direct" for t in stream_targets):
        raise ValueError("--stream-targets needs direct: added latency is measured against it")
    report = OverheadReport(_settings(options))
    total = (
        len(cells) * len(grid_targets)
        + len(options.long_tokens) * options.long_turns * len(long_targets)
        + len(options.streams) * len(stream_targets)
    )
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task("starting", total=total)
    with contextlib.ExitStack() as stack:
        log_dir = options.log_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoverhead-"))
        )
        live = stack.enter_context(
            Live(Group(grid_table([]), progress), console=console, refresh_per_second=4)
        )

        def show() -> None:
            tables = [grid_table(report.cells), long_table(summarize(report.long_turns))]
            live.update(Group(*tables, streaming_table(report.streams), progress))

        def advance(label: str) -> Callable[[Any], None]:
            def on_result(result: Any) -> None:
                progress.update(task, advance=1, description=label)
                if isinstance(result, CellResult):
                    report.cells.append(result)
                elif isinstance(result, StreamResult):
                    report.streams.append(result)
                else:
                    report.long_turns.append(result)
                show()
                if not console.is_terminal:  # a log has no live display: one line per measurement instead
                    done = int(progress.tasks[0].completed)
                    console.print(f"[{done}/{total}] {_one_line(result)}", highlight=False)

            return on_result

        if cells and wrk is not None and nginx is not None:
            progress.update(task, description="grid: starting nginx and the routers")
            with _grid_fleet(nginx, grid_targets, options, log_dir) as runs:
                warm_up(wrk, runs, log_dir / "lua")
                profiler = _profiler(options, cells)
                run_grid(wrk, runs, cells, options.duration_s, log_dir / "lua", advance("grid"), profiler)
                report.profiles = [] if profiler is None else profiler.profiles
                order = [t.label for t in grid_targets]
                report.cells.sort(
                    key=lambda r: (r.concurrency, r.size_bytes, r.prompt, order.index(r.target))
                )
                report.routers += _processes("grid", runs)
        if long_targets:
            progress.update(task, description="long prompts: starting backends and the routers")
            with _long_fleet(long_targets, options, log_dir) as runs:
                asyncio.run(run_long(runs, options.long_tokens, options.long_turns, advance("long prompts")))
                report.routers += _processes("long", runs)
                report.vllm_router_counters = _kv_aware_counters(runs)
        if stream_targets:
            progress.update(task, description="streaming: starting the engine and the routers")
            settings = options.stream
            with streaming_fleet(stream_targets, settings, log_dir, options.vllm_router) as fleet:
                engine, ports, runs = fleet
                warm_up_streams(runs, ports, settings)
                run_streaming(engine, ports, runs, options.streams, settings, advance("streaming"))
                order = [t.label for t in stream_targets]
                report.streams.sort(key=lambda r: (r.concurrency, order.index(r.target)))
                report.routers += _processes("streaming", runs)
        show()
    summaries = summarize(report.long_turns)
    if any(profile.stages for profile in report.profiles):
        console.print(stages_table(report.profiles, report.cells))
    console.print(verdict_table(verdicts(report.cells, summaries, report.streams)))
    for process in report.routers:
        if process.skipped:
            console.print(f"[yellow]{process.phase} {process.target} skipped: {escape(process.skipped)}")
    if options.plots is not None:
        report.plots = [str(p) for p in plot(report.cells, report.long_turns, options.plots, "overhead")]
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        console.print(
            f"results: {options.out}" + (f", plots: {', '.join(report.plots)}" if report.plots else "")
        )
    return report


def _profiler(options: OverheadOptions, cells: Sequence[Cell]) -> Profiler | None:
    if options.profile_dir is None:
        return None
    binary = find_py_spy()
    if binary is None:
        raise MissingTool("py-spy not found: pip install 'kvroute[bench]'")
    return Profiler(binary, options.profile_dir, options.duration_s, max(c.concurrency for c in cells))


def _one_line(result: CellResult | LongResult | StreamResult) -> str:
    if isinstance(result, StreamResult):
        return (
            f"{result.target} {result.concurrency} streams: {result.tokens_per_s:,.0f} tokens/s, TTFB p50 "
            f"{result.ttfb_p50_ms or 0:.2f} ms, ITL p99 {result.itl_p99_ms or 0:.2f} ms, cores: "
            + ("" if result.router_cores is None else f"router {result.router_cores:.2f}, ")
            + f"engine {result.engine_cores:.2f}, "
            f"client {result.client_cores:.2f}" + (f", errors: {result.errors}" if result.errors else "")
        )
    if isinstance(result, CellResult):
        return (
            f"{result.target} c={result.concurrency} {result.size_bytes} B {result.prompt}: "
            f"{result.requests_per_s:,.0f} req/s, p50 {result.p50_ms:.2f} ms, p99 {result.p99_ms:.2f} ms"
            + (f", failed: {result.failed}" if result.failed else "")
        )
    latency = "-" if result.latency_ms is None else f"{result.latency_ms:.1f} ms"
    return f"{result.target} {result.tokens:,} tokens turn {result.turn + 1}: {latency} {result.error}"


@contextlib.contextmanager
def _grid_fleet(
    nginx: str, targets: Sequence[Any], options: OverheadOptions, log_dir: Path
) -> Iterator[list[Running]]:
    base = free_port_block(2)
    ports = [base, base + 1]
    server = start_nginx(nginx, ports, log_dir)
    try:
        with running_targets(targets, backend_fleet(ports), log_dir, options.vllm_router) as runs:
            yield runs
    finally:
        server.stop()


@contextlib.contextmanager
def _long_fleet(targets: Sequence[Any], options: OverheadOptions, log_dir: Path) -> Iterator[list[Running]]:
    base = free_port_block(4)
    ports = [base, base + 1]
    backends = start_render_backends(ports, log_dir)
    try:
        fleet = backend_fleet(ports, event_ports=[base + 2, base + 3])
        with running_targets(targets, fleet, log_dir, options.vllm_router) as runs:
            yield runs
    finally:
        for backend in backends:
            backend.stop()


def _processes(phase: str, runs: Sequence[Running]) -> list[RouterProcess]:
    return [
        RouterProcess(phase, r.target.label, r.skipped, r.peak_rss_mib())
        for r in runs
        if r.target.kind != "direct"
    ]


def _kv_aware_counters(runs: Sequence[Running]) -> dict[str, float]:
    for run in runs:
        if run.target.label == "vllm-router:kv_aware" and run.url:
            host, _, port = run.url.rpartition(":")
            return vllm_router_counters(f"{host}:{int(port) + 1}")  # its metrics port, next to its own
    return {}


def _settings(options: OverheadOptions) -> dict[str, Any]:
    return {
        "duration_s": options.duration_s,
        "concurrency": list(options.concurrency),
        "sizes_bytes": list(options.sizes),
        "prompts": list(options.prompts),
        "targets": list(options.targets),
        "long_tokens": list(options.long_tokens),
        "long_turns": options.long_turns,
        "long_targets": list(options.long_targets),
        "streams": list(options.streams),
        "stream_tokens": options.stream.tokens,
        "stream_step_ms": options.stream.step_ms,
        "stream_targets": list(options.stream_targets),
        "cpus": os.cpu_count(),
        "backend": "nginx, 1 worker, canned chat completion; long prompts: aiohttp backend that tokenizes; "
        "streaming: kvroute.bench.overhead.stream_engine (one process, two ports, one step clock)",
        "load_generator": "wrk -t1; streaming: kvroute.bench.overhead.stream_client (one process)",
    }


def run_command(args: argparse.Namespace) -> int:
    """`kvroute bench overhead` with its parsed arguments (kvroute/bench/overhead/command.py)."""
    options = OverheadOptions(
        duration_s=args.duration,
        concurrency=args.concurrency,
        sizes=args.sizes,
        prompts=args.prompts,
        targets=args.targets,
        long_tokens=args.long_tokens,
        long_turns=args.long_turns,
        long_targets=args.long_targets,
        streams=args.streams,
        stream=StreamSettings(args.stream_tokens, args.stream_step_ms, args.duration),
        stream_targets=args.stream_targets,
        vllm_router=args.vllm_router,
        out=Path(args.out) if args.out else None,
        plots=Path(args.plots) if args.plots else None,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        profile_dir=Path(args.profile) if args.profile else None,
    )
    bad = [p for p in options.prompts if p not in ("hot", "cold")]
    if bad:
        raise SystemExit(f"--prompts: {', '.join(bad)}: use hot and/or cold")
    try:
        run_overhead_bench(options)
    except (MissingTool, StartupError, ValueError) as exc:
        Console(stderr=True).print(f"[red]bench overhead: {escape(str(exc))}")
        return 2
    return 0
