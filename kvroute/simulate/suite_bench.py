"""Running the suite for `kvroute bench simulate --suite`: progress, the table, `DIR/suite.json`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvroute.simulate import report, suite_report
from kvroute.simulate.hardware import FleetSpec, PoolSpec
from kvroute.simulate.suite import Cell, JobResult, jobs_for, run_jobs


def run_suite(
    cells: Sequence[Cell],
    policies: Sequence[str],
    template: FleetSpec,
    requests: int,
    workers: int,
    out: Path,
    tie_seed: int = 0,
    console: Console | None = None,
) -> list[JobResult]:
    """Every policy in every cell, on template's hardware; cells with a pool get template's (or the
    reference pool)."""
    console = console or Console(width=200)
    template = template if template.pool is not None else replace(template, pool=PoolSpec())
    jobs = jobs_for(cells, policies, requests, template, tie_seed)
    started = time.perf_counter()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        task = progress.add_task(f"{len(cells)} cells x {len(policies)} policies", total=len(jobs))

        def done(result: JobResult) -> None:
            label = f"{result.job.cell.label}: {result.job.policy}"
            progress.update(task, advance=1, description=label)
            if not console.is_terminal:  # a log file gets a line a job: the bar is drawn only at the end
                elapsed = time.perf_counter() - started
                console.print(f"{elapsed / 60:5.1f} min  {label} ({result.result.wall_s:.0f} s)")

        results = run_jobs(jobs, workers, done)
    wall_s = time.perf_counter() - started
    plural = "s" if workers > 1 else ""
    title = (
        f"suite: {len(cells)} cells, at most {requests} requests each, kvroute against the best "
        f"peer per measure ({wall_s / 60:.1f} min, {workers} worker{plural})"
    )
    console.print(suite_report.table(title, results))
    flows = suite_report.flows_table(results)
    if flows is not None:
        console.print(flows)
    facts = suite_report.summary(results)
    console.print(suite_report.summary_line(facts))
    document = {
        "cells": [asdict(cell) for cell in cells],
        "policies": list(policies),
        "requests_cap": requests,
        "setup": asdict(template),
        "tie_seed": tie_seed,
        "workers": workers,
        "wall_s": wall_s,
        "summary": facts,
        "records": suite_report.records(results),
    }
    report.write_json(out / "suite.json", document)
    console.print(f"results: {out / 'suite.json'}")
    return results
