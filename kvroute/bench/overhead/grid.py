"""The grid of ``kvroute bench overhead``: every target x concurrency x prompt size x hot/cold, run by wrk
against nginx, interleaved (each cell runs every target back to back, in a rotating order)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.bench.overhead.profiler import Profiler
from kvroute.bench.overhead.targets import DIRECT, Running, rotated
from kvroute.bench.overhead.wrk import Prompt, WrkError, run_wrk


@dataclass(frozen=True)
class Cell:
    concurrency: int
    size_bytes: int
    prompt: str  # hot or cold

    @property
    def key(self) -> tuple[int, int, str]:
        return self.concurrency, self.size_bytes, self.prompt


@dataclass
class CellResult:
    target: str
    concurrency: int
    size_bytes: int
    prompt: str
    requests: int = 0
    errors: int = 0
    duration_s: float = 0.0
    requests_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    router_cpu_s: float | None = None  # None: no router process (direct)
    cpu_ms_per_1k: float | None = None  # router CPU milliseconds per 1,000 requests
    system_cpu_ms_per_1k: float | None = None  # of those, in the kernel (system calls)
    helpers_cpu_ms_per_1k: float | None = None  # of those, its helpers' (Envoy's picker); None: it has none
    peak_rss_mib: float | None = None  # the router's VmHWM after this cell
    added_p50_ms: float | None = None  # over direct in the same cell
    added_p99_ms: float | None = None
    throughput_vs_direct: float | None = None
    throughput_vs_vllm_router: float | None = None  # over vllm-router:round_robin in the same cell
    failed: str = ""


def grid(concurrency: Sequence[int], sizes: Sequence[int], prompts: Sequence[str]) -> list[Cell]:
    return [Cell(c, s, p) for c in concurrency for s in sizes for p in prompts]


def warm_up(wrk: str, runs: Sequence[Running], script_dir: Path) -> None:
    """Connections open, tokenizers loaded, first-call paths taken: none of that counts in any cell."""
    for run in runs:
        if not run.skipped:
            run_wrk(wrk, run.url, Prompt(256, True, f"warm-{uuid.uuid4().hex[:8]}"), 8, 1, script_dir)


def run_grid(
    wrk: str,
    runs: Sequence[Running],
    cells: Sequence[Cell],
    duration_s: float,
    script_dir: Path,
    on_result: Callable[[CellResult], None],
    profiler: Profiler | None = None,
) -> list[CellResult]:
    """profiler: after a cell's measured runs, one more run of each router it wants, under py-spy (whose
    pauses would distort the measured numbers)."""
    active = [r for r in runs if not r.skipped]
    results: list[CellResult] = []
    for index, cell in enumerate(cells):
        cell_results = []
        for run in rotated(active, index):
            result = _run_cell(wrk, run, cell, duration_s, script_dir)
            cell_results.append(result)
            on_result(result)
        _compare(cell_results)
        results.extend(cell_results)
        if profiler is not None:
            for run in active:
                _profile_cell(wrk, run, cell, duration_s, script_dir, profiler)
    return results


def _profile_cell(
    wrk: str, run: Running, cell: Cell, duration_s: float, script_dir: Path, profiler: Profiler
) -> None:
    recording = profiler.start(run.target.label, run.target.kind, run.pid, *cell.key)
    if recording is None:
        return
    prompt = Prompt(cell.size_bytes, cell.prompt == "cold", uuid.uuid4().hex[:12])
    try:
        run_wrk(wrk, run.url, prompt, cell.concurrency, duration_s, script_dir)
    finally:
        profiler.finish(recording)


def _run_cell(wrk: str, run: Running, cell: Cell, duration_s: float, script_dir: Path) -> CellResult:
    result = CellResult(run.target.label, cell.concurrency, cell.size_bytes, cell.prompt)
    prompt = Prompt(cell.size_bytes, cell.prompt == "cold", uuid.uuid4().hex[:12])
    before = run.user_system_seconds()  # every process of the target: `serve --workers` has several
    helpers_before = run.helpers_cpu_seconds()
    try:
        measured = run_wrk(wrk, run.url, prompt, cell.concurrency, duration_s, script_dir)
    except WrkError as exc:
        result.failed = str(exc)
        return result
    result.requests, result.errors = measured.requests, measured.errors
    result.duration_s = measured.duration_us / 1e6
    result.requests_per_s = measured.requests_per_s
    result.p50_ms, result.p99_ms = measured.p50_us / 1000, measured.p99_us / 1000
    result.mean_ms = measured.mean_us / 1000
    after = run.user_system_seconds()
    if before is not None and after is not None:
        result.router_cpu_s = sum(after) - sum(before)
        if measured.requests:
            result.cpu_ms_per_1k = result.router_cpu_s * 1000 / measured.requests * 1000
            result.system_cpu_ms_per_1k = (after[1] - before[1]) * 1e6 / measured.requests
            helpers_after = run.helpers_cpu_seconds()
            if helpers_before is not None and helpers_after is not None:
                result.helpers_cpu_ms_per_1k = (helpers_after - helpers_before) * 1e6 / measured.requests
        result.peak_rss_mib = run.peak_rss_mib()
    return result


def _compare(cell_results: Sequence[CellResult]) -> None:
    by_target = {r.target: r for r in cell_results if not r.failed and r.requests}
    direct = by_target.get(DIRECT)
    reference = by_target.get("vllm-router:round_robin")
    for result in by_target.values():
        if direct is not None and result is not direct:
            result.added_p50_ms = result.p50_ms - direct.p50_ms
            result.added_p99_ms = result.p99_ms - direct.p99_ms
            result.throughput_vs_direct = result.requests_per_s / direct.requests_per_s
        if reference is not None:
            result.throughput_vs_vllm_router = result.requests_per_s / reference.requests_per_s
