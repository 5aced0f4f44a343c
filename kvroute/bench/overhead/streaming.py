"""The streaming case of ``kvroute bench overhead``: streamed answers relayed by each router, measured chunk
by chunk against the same engine reached directly.

The engine (kvroute/bench/overhead/stream_engine.py, one process on two ports) paces every stream by one
decode step clock; the client (kvroute/bench/overhead/stream_client.py, a process of its own) keeps N streams
going and times each chunk. Each concurrency runs every target back to back, in an order that rotates from one
concurrency to the next, after a short warm-up of each. What a router adds is its percentile minus direct's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvroute.bench.live.run import Target
from kvroute.bench.overhead.targets import (
    DIRECT,
    Running,
    backend_fleet,
    cpu_seconds,
    rotated,
    running_targets,
)
from kvroute.processes import Child, free_port_block, spawn, wait_healthy

VLLM_RR = "vllm-router:round_robin"
_CHAT = "/v1/chat/completions"
_LATENCIES = ("ttfb_p50_ms", "ttfb_p99_ms", "itl_p50_ms", "itl_p99_ms")


@dataclass(frozen=True)
class StreamSettings:
    tokens: int = 256
    step_ms: float = 20.0
    duration_s: float = 5.0  # the measured window of each run


@dataclass
class StreamResult:
    target: str
    concurrency: int
    tokens: int  # per stream
    step_ms: float
    streams: int = 0
    ok: int = 0
    failed_streams: int = 0
    errors: str = ""  # the client's error reasons with counts, or why the run gave nothing
    tokens_per_s: float = 0.0  # relayed, in the window
    ttfb_p50_ms: float | None = None
    ttfb_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    added_ttfb_p50_ms: float | None = None  # over direct, same concurrency
    added_ttfb_p99_ms: float | None = None
    added_itl_p50_ms: float | None = None
    added_itl_p99_ms: float | None = None
    tokens_per_s_vs_direct: float | None = None
    tokens_per_s_vs_vllm_router: float | None = None
    router_cores: float | None = None  # the router's CPU seconds (all its processes) per second of the run
    cpu_ms_per_1k_tokens: float | None = None
    peak_rss_mib: float | None = None
    engine_cores: float = 0.0
    client_cores: float = 0.0


@contextmanager
def running_engine(settings: StreamSettings, log_dir: Path) -> Iterator[tuple[Child, list[int]]]:
    """One engine process on two ports (routers get two instances); stopped by its process group."""
    base = free_port_block(2)
    ports = [base, base + 1]
    argv = [
        sys.executable,
        "-m",
        "kvroute.bench.overhead.stream_engine",
        *map(str, ports),
        "--step-ms",
        str(settings.step_ms),
        "--tokens",
        str(settings.tokens),
    ]
    child = spawn("stream-engine", argv, log_dir)
    try:
        wait_healthy(child, [f"http://127.0.0.1:{port}/health" for port in ports], timeout_s=30)
        yield child, ports
    finally:
        child.stop()


@contextmanager
def streaming_fleet(
    targets: Sequence[Target], settings: StreamSettings, log_dir: Path, vllm_router: str | None
) -> Iterator[tuple[Child, list[int], list[Running]]]:
    """The engine, its ports and the targets in front of it, all started at once."""
    with running_engine(settings, log_dir) as (engine, ports):
        with running_targets(targets, backend_fleet(ports), log_dir, vllm_router) as runs:
            yield engine, ports, runs


def run_client(
    urls: Sequence[str], streams: int, tokens: int, step_ms: float, duration_s: float
) -> dict[str, object]:
    argv = [
        sys.executable,
        "-m",
        "kvroute.bench.overhead.stream_client",
        *urls,
        "--streams",
        str(streams),
        "--tokens",
        str(tokens),
        "--step-ms",
        str(step_ms),
        "--duration",
        str(duration_s),
        "--tag",
        uuid.uuid4().hex[:12],
    ]
    bound = 120 + duration_s + 6 * tokens * step_ms / 1000
    done = subprocess.run(argv, capture_output=True, text=True, timeout=bound, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"stream client exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _urls(run: Running, ports: Sequence[int]) -> list[str]:
    if run.target.kind == DIRECT:  # connections alternate over both ports, as a router spreads them
        return [f"http://127.0.0.1:{port}{_CHAT}" for port in ports]
    return [run.url + _CHAT]


def warm_up(runs: Sequence[Running], ports: Sequence[int], settings: StreamSettings) -> None:
    """Connections open, first-call paths taken: a few short streams through each target."""
    for run in runs:
        if not run.skipped:
            run_client(_urls(run, ports), 8, 8, settings.step_ms, 0.2)


def run_streaming(
    engine: Child,
    ports: Sequence[int],
    runs: Sequence[Running],
    concurrency: Sequence[int],
    settings: StreamSettings,
    on_result: Callable[[StreamResult], None],
) -> list[StreamResult]:
    active = [r for r in runs if not r.skipped]
    results: list[StreamResult] = []
    for index, streams in enumerate(concurrency):
        level = []
        for run in rotated(active, index):
            result = _measure(engine, ports, run, streams, settings)
            level.append(result)
            on_result(result)
        _compare(level)
        results.extend(level)
    return results


def _measure(
    engine: Child, ports: Sequence[int], run: Running, streams: int, settings: StreamSettings
) -> StreamResult:
    result = StreamResult(run.target.label, streams, settings.tokens, settings.step_ms)
    router_before, engine_before = run.cpu_seconds(), cpu_seconds(engine.process.pid)
    started = time.monotonic()
    try:
        stats = run_client(_urls(run, ports), streams, settings.tokens, settings.step_ms, settings.duration_s)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        result.errors = str(exc)
        return result
    wall_s = time.monotonic() - started
    for name in ("streams", "ok", "tokens_per_s", *_LATENCIES, "itl_max_ms"):
        setattr(result, name, stats[name])
    result.failed_streams = int(stats["failed"])  # type: ignore[call-overload]
    errors: dict[str, int] = stats["errors"]  # type: ignore[assignment]
    result.errors = ", ".join(f"{reason}: {count}" for reason, count in errors.items())
    result.client_cores = float(stats["client_cpu_share"])  # type: ignore[arg-type]
    result.engine_cores = (cpu_seconds(engine.process.pid) - engine_before) / wall_s
    router_after = run.cpu_seconds()
    if router_before is not None and router_after is not None:
        cpu_s = router_after - router_before
        result.router_cores = cpu_s / wall_s
        tokens = int(stats["tokens"])  # type: ignore[call-overload]
        if tokens:
            result.cpu_ms_per_1k_tokens = cpu_s * 1000 / tokens * 1000
        result.peak_rss_mib = run.peak_rss_mib()
    return result


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _compare(level: Sequence[StreamResult]) -> None:
    by_target = {r.target: r for r in level if r.tokens_per_s > 0}
    direct, reference = by_target.get(DIRECT), by_target.get(VLLM_RR)
    for result in by_target.values():
        if direct is not None and result is not direct:
            for name in _LATENCIES:
                setattr(result, f"added_{name}", _minus(getattr(result, name), getattr(direct, name)))
            result.tokens_per_s_vs_direct = result.tokens_per_s / direct.tokens_per_s
        if reference is not None:
            result.tokens_per_s_vs_vllm_router = result.tokens_per_s / reference.tokens_per_s
