"""`kvroute bench simulate --suite`: every policy on a grid of workloads x fleet sizes x loads x pool.

A cell is one workload on one fleet at one offered load, with or without the pool. Its policies run as
separate jobs (one simulation each), in this process or in worker processes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from functools import lru_cache

from kvroute.simulate.bench import rate_for_load
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.registry import policies_for
from kvroute.simulate.results import RunResult
from kvroute.simulate.simulation import simulate
from kvroute.simulate.workloads import (
    bursty_trace,
    chat_trace,
    long_context_trace,
    rag_trace,
    skewed_flows_trace,
    tenants_trace,
)
from kvroute.traces import Trace, agentic_trace, mooncake_trace

AGENTIC_SESSIONS = 40  # `--trace agentic`'s default, so agentic-N is `--trace agentic --seed N`'s trace
LONG_CONTEXT_TURNS = 8  # about the turns a long-context session has: sessions enough for the requests


def agent_tools_trace(seed: int, sessions: int = 48) -> Trace:
    """A held-out family the defaults were never tuned on: coding-agent sessions whose next turn follows a
    tool call, mostly within a second (vllm-router's published coding-agent trace: 86% within 1 s, 95% within
    10 s), with a longer shared system prompt, shorter steps and fewer turns than the agentic trace's."""
    return agentic_trace(
        seed=seed,
        sessions=sessions,
        median_turns=25,
        system_tokens=8000,
        median_new_tokens=1200,
        median_think_s=0.3,
        think_sigma=1.4,
        min_think_s=0.05,
        max_think_s=60.0,
        name="agent-tools",
    )


WORKLOADS: dict[str, Callable[[int, int], Trace]] = {
    "mooncake": lambda seed, n: mooncake_trace().head(n),
    "agentic": lambda seed, n: agentic_trace(seed=seed, sessions=AGENTIC_SESSIONS).head(n),
    "rag": lambda seed, n: rag_trace(seed, n),
    "bursty": lambda seed, n: bursty_trace(seed, n),
    "long-context": lambda seed, n: long_context_trace(seed, max(8, n // LONG_CONTEXT_TURNS)).head(n),
    "chat": lambda seed, n: chat_trace(seed, n),
    "tenants": lambda seed, n: tenants_trace(seed, n),
    "flows": lambda seed, n: skewed_flows_trace(seed, n),
    # Held out: not in the default suite, run with --suite-cells.
    "agent-tools": lambda seed, n: agent_tools_trace(seed).head(n),
    # The agentic sessions with a screenshot ending every fourth turn: text-only routers' keys part there
    "images": lambda seed, n: agentic_trace(
        seed=seed, sessions=AGENTIC_SESSIONS, images_every=4, name="images"
    ).head(n),
    "mooncake-window": lambda seed, n: mooncake_trace().skip(seed * n).head(n),  # its seed-th n requests
}
_NAME = re.compile(r"(?P<kind>[a-z-]+?)(?:-(?P<seed>\d+))?")

AXES = ("workload", "instances", "load", "pool")
FULL_GRID: dict[str, tuple[str, ...]] = {
    "workload": (
        "mooncake",
        *(f"agentic-{seed}" for seed in range(5)),
        "rag",
        "bursty",
        "long-context",
        "chat",
        "tenants",
        "flows",
    ),
    "instances": ("16", "32"),
    "load": ("0.5", "0.7", "0.9"),
    "pool": ("on", "off"),
}
# `--suite-cells` replaces axes of the base grid: every workload on 16 instances at load 0.7, pool on.
BASE_GRID: dict[str, tuple[str, ...]] = {
    "workload": FULL_GRID["workload"][:-2],
    "instances": ("16",),
    "load": ("0.7",),
    "pool": ("on",),
}
# `--suite` alone: the base grid; every fleet, load and pool setting for the workloads that simulate fast;
# one axis at a time moved off the base point (load 0.5 and 0.9, 32 instances, no pool) for one agentic seed
# and the long-context sessions, whose 40K-150K-token prompts cost kvroute's decision ~10x more simulation
# a request. 62 cells, ~30 minutes on this 2-core machine (docs/bench-simulate.md).
_FAST = ("mooncake", "rag", "bursty", "chat")
_SLOW = ("agentic-0", "long-context")
_TENANTS = ("tenants", "flows")  # two flows each (kvroute/simulate/workloads.py)
DEFAULT_GRIDS: tuple[dict[str, tuple[str, ...]], ...] = (
    BASE_GRID,
    {**BASE_GRID, "workload": _TENANTS, "load": ("0.7", "0.9")},
    {**FULL_GRID, "workload": _FAST},
    {**BASE_GRID, "workload": _SLOW, "load": ("0.5", "0.9")},
    {**BASE_GRID, "workload": _SLOW, "instances": ("32",)},
    {**BASE_GRID, "workload": _SLOW, "pool": ("off",)},
)


def workload_trace(name: str, requests: int) -> Trace:
    """The trace a suite workload names: `KIND` or `KIND-SEED` (seed 0 by default), its first `requests`."""
    kind, seed = _workload(name)
    return WORKLOADS[kind](seed, requests)


def _workload(name: str) -> tuple[str, int]:
    match = _NAME.fullmatch(name)
    if match is None or match["kind"] not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)} (with -SEED)")
    if match["kind"] == "mooncake" and match["seed"]:
        raise ValueError("the Mooncake trace is recorded, not generated: it takes no seed")
    return match["kind"], int(match["seed"] or 0)


@dataclass(frozen=True)
class Cell:
    workload: str
    instances: int
    load: float
    pool: bool

    @property
    def label(self) -> str:
        return f"{self.workload} x{self.instances} load {self.load:g} pool {'on' if self.pool else 'off'}"

    def fleet(self, template: FleetSpec) -> FleetSpec:
        """template's hardware (its pool's link too) with this cell's instances and pool."""
        return replace(template, instances=self.instances, pool=template.pool if self.pool else None)


def parse_cells(spec: str | None) -> list[Cell]:
    """The cells a `--suite-cells` spec selects: `AXIS=V1,V2` terms separated by spaces or `;`, each
    replacing that axis of the base grid; `AXIS=all` takes every value of the full grid, and `all` alone
    the full grid. Workloads may name any seed (`rag-3`). No spec: the default suite."""
    if spec is None:
        cells = dict.fromkeys(cell for grid in DEFAULT_GRIDS for cell in _cells(grid))
        order = FULL_GRID["workload"]
        return sorted(cells, key=lambda c: (order.index(c.workload), c.instances, c.load, not c.pool))
    grid = dict(BASE_GRID)
    for term in re.split(r"[\s;]+", spec.strip()):
        if not term:
            continue
        if term == "all":
            grid = dict(FULL_GRID)
            continue
        axis, equals, values = term.partition("=")
        if not equals or axis not in AXES or not values:
            raise ValueError(f"{term!r} is not AXIS=V1,V2 with AXIS one of {', '.join(AXES)}")
        grid[axis] = FULL_GRID[axis] if values == "all" else tuple(values.split(","))
    return list(dict.fromkeys(_cells(grid)))


def _cells(grid: Mapping[str, Sequence[str]]) -> Iterator[Cell]:
    for workload in grid["workload"]:
        _workload(workload)
        for instances in grid["instances"]:
            for load in grid["load"]:
                for pool in grid["pool"]:
                    yield Cell(workload, _count(instances), _load(load), _pool(pool))


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"instances {text!r} is not a positive integer")
    return int(text)


def _load(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"load {text!r} is not a number") from None
    if not 0 < value < 10:
        raise ValueError(f"load {text!r} is not in (0, 10)")
    return value


def _pool(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError(f"pool {text!r} is not on or off")
    return text == "on"


@dataclass(frozen=True)
class Job:
    cell: Cell
    policy: str
    requests: int
    template: FleetSpec
    tie_seed: int


@dataclass(frozen=True)
class JobResult:
    job: Job
    requests: int  # the cell's trace may have fewer than the cap
    rate: float
    result: RunResult


@lru_cache(maxsize=4)
def _prepared(workload: str, requests: int, block_size: int) -> tuple[TraceBlocks, float]:
    """A workload's hashed blocks and ideal hit rate, kept for the next policy of the same cell."""
    blocks = TraceBlocks(workload_trace(workload, requests), block_size)
    return blocks, blocks.ideal_hit_rate()


def run_job(job: Job) -> JobResult:
    fleet = job.cell.fleet(job.template)
    blocks, ideal = _prepared(job.cell.workload, job.requests, fleet.engine.block_size)
    rate = rate_for_load(blocks, fleet, job.cell.load, ideal)
    scaled = blocks.with_trace(blocks.trace.with_rate(rate))
    policy = policies_for(fleet)[job.policy](fleet)
    result = simulate(scaled, fleet, policy, ideal, tie_seed=job.tie_seed)
    if (
        "interactive" in result.flows
    ):  # what the interactive flow gets alone, at the same rate, for comparison
        alone = _of_flow(scaled, "interactive")
        policy = policies_for(fleet)[job.policy](fleet)
        result.flows["interactive-alone"] = simulate(
            alone, fleet, policy, ideal, tie_seed=job.tie_seed
        ).flows["interactive"]
    return JobResult(job, len(blocks.trace.requests), rate, result)


def _of_flow(blocks: TraceBlocks, flow: str) -> TraceBlocks:
    """The requests of one flow, at the times they have beside the others."""
    kept = [n for n, request in enumerate(blocks.trace.requests) if request.flow == flow]
    trace = replace(blocks.trace, requests=tuple(blocks.trace.requests[n] for n in kept))
    return TraceBlocks(trace, blocks.block_size, [blocks.chains[n] for n in kept])


def jobs_for(
    cells: Sequence[Cell], policies: Sequence[str], requests: int, template: FleetSpec, tie_seed: int
) -> list[Job]:
    """A job per cell and policy, a cell's jobs together (its trace is hashed once per process)."""
    return [Job(cell, name, requests, template, tie_seed) for cell in cells for name in policies]


def run_jobs(
    jobs: Sequence[Job], workers: int, done: Callable[[JobResult], None] | None = None
) -> list[JobResult]:
    """Every job, in worker processes when workers > 1; results in the jobs' order."""
    finished: dict[int, JobResult] = {}
    if workers <= 1:
        for number, job in enumerate(jobs):
            finished[number] = run_job(job)
            if done is not None:
                done(finished[number])
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run_job, job): number for number, job in enumerate(jobs)}
            for future in as_completed(futures):
                finished[futures[future]] = future.result()
                if done is not None:
                    done(finished[futures[future]])
    return [finished[number] for number in range(len(jobs))]
