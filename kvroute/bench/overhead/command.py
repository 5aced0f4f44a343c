"""`kvroute bench overhead`: its arguments and entry point (run.py runs it)."""

from __future__ import annotations

import argparse

from kvroute.bench.overhead.defaults import GRID_TARGETS, LONG_TARGETS, STREAM_TARGETS
from kvroute.extras import requires_extra


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_overhead_parser(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    overhead = benches.add_parser("overhead", help="the router's own latency, throughput and CPU cost")
    add = overhead.add_argument
    add("--duration", type=float, default=5.0, help="seconds of wrk per grid cell and target (default 5)")
    add("--concurrency", type=_ints, default=(1, 64), help="wrk connections, comma-separated (default 1,64)")
    add("--sizes", type=_ints, default=(200, 2048, 16384), help="request body bytes (default 200,2048,16384)")
    add("--prompts", type=_names, default=("hot", "cold"), help="hot (one prompt repeated), cold (each new)")
    add(
        "--targets",
        type=_names,
        default=GRID_TARGETS,
        help=f"grid targets ('' for no grid; default {','.join(GRID_TARGETS)})",
    )
    add(
        "--long-tokens",
        type=_ints,
        default=(10_000, 50_000, 100_000),
        help="long-prompt sizes in tokens ('' to skip; default 10000,50000,100000)",
    )
    add("--long-turns", type=int, default=4, help="agent turns per long-prompt session (default 4)")
    add("--long-targets", type=_names, default=LONG_TARGETS, help=f"default {','.join(LONG_TARGETS)}")
    add(
        "--streams",
        type=_ints,
        default=(64, 256),
        help="concurrent streams, comma-separated ('' skips the streaming case; default 64,256); each run "
        "streams for --duration seconds after all have started",
    )
    add("--stream-tokens", type=int, default=256, help="tokens per streamed answer (default 256)")
    add("--stream-step-ms", type=float, default=20.0, help="the engine's time between tokens (default 20)")
    add("--stream-targets", type=_names, default=STREAM_TARGETS, help=f"default {','.join(STREAM_TARGETS)}")
    add("--vllm-router", help="the vllm-router binary (default: next to this Python, or on PATH)")
    add("--out", default="bench-results/overhead.json", help="JSON results ('' for none)")
    add("--plots", default="bench-results", help="directory for overhead-*.png ('' for none)")
    add("--log-dir", help="keep the processes' logs here (default: a temporary directory)")
    add(
        "--profile",
        metavar="DIR",
        help="also run each kvroute grid cell at the highest concurrency under py-spy, raw stacks to DIR, "
        "top functions in the JSON",
    )
    overhead.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    with requires_extra("bench"):
        from kvroute.bench.overhead.run import run_command

    return run_command(args)
