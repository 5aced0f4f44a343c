"""The suite's verdicts: each policy against the best peer of its cell, issue 32's targets, the table and
the JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.table import Table

from kvroute.simulate.registry import POLICIES
from kvroute.simulate.report import as_json
from kvroute.simulate.results import RunResult
from kvroute.simulate.suite import Cell, JobResult

SUBJECT = "kvroute"
P50_TARGET = 1.1  # TTFT p50 at most 1.1x the best peer's
P99_TARGET = 1.0  # TTFT p99 at most the best peer's
HIT_TARGET = 0.95  # hits at least 95% of one infinite shared cache's
SHORT = {
    "round-robin": "rr",
    "consistent-hash": "hash",
    "power-of-two": "p2c",
    "sglang-cache-aware": "sgl",
    "llm-d": "llmd",
    "llm-d+flow-control": "llmd+fc",
    "dynamo": "dyn",
    "dynamo+queue-fcfs": "dyn+qf",
    "dynamo+queue-wspt": "dyn+qw",
    "vllm-router-kv-aware": "kva",
    "vllm-router-kv-aware+affinity": "kva+aff",
    "vllm-router-kv-aware+programs": "kva+prog",
    "vllm-router-sticky": "sticky",
    "kvroute-no-queue": "kvr-nq",
    "kvroute": "kvr",
}


@dataclass(frozen=True)
class Verdict:
    """One policy in one cell against its best peer, per measure: the lowest TTFT p50 of the peers, the
    lowest p99 and the fewest rejected may come from different peers."""

    ttft_p50_ratio: float
    ttft_p50_peer: str
    ttft_p99_ratio: float
    ttft_p99_peer: str
    rejected: int
    peer_rejected: int
    rejected_peer: str
    hit_share_of_ideal: float

    @property
    def missed(self) -> list[str]:
        """The targets it misses: `p50`, `p99`, `rejected`, `hit`."""
        return [
            name
            for name, met in (
                ("p50", self.ttft_p50_ratio <= P50_TARGET),
                ("p99", self.ttft_p99_ratio <= P99_TARGET),
                ("rejected", self.rejected <= self.peer_rejected),
                ("hit", self.hit_share_of_ideal >= HIT_TARGET),
            )
            if not met
        ]


def peers_of(name: str, results: Sequence[RunResult]) -> list[RunResult]:
    """The published routers among results, each shipped variant of one a peer of its own (a peer's best
    is the best of its variants), name itself left out (kvroute's variants are no peers)."""
    return [
        r for r in results if r.policy in POLICIES and r.policy != name and not r.policy.startswith(SUBJECT)
    ]


def verdict(result: RunResult, peers: Sequence[RunResult]) -> Verdict | None:
    if not peers:
        return None
    p50 = min(peers, key=lambda r: r.ttft_p50_s)
    p99 = min(peers, key=lambda r: r.ttft_p99_s)
    rejected = min(peers, key=lambda r: r.rejected)
    hits = result.local_hit_rate + result.pool_hit_rate
    return Verdict(
        ttft_p50_ratio=result.ttft_p50_s / max(p50.ttft_p50_s, 1e-9),
        ttft_p50_peer=p50.policy,
        ttft_p99_ratio=result.ttft_p99_s / max(p99.ttft_p99_s, 1e-9),
        ttft_p99_peer=p99.policy,
        rejected=result.rejected,
        peer_rejected=rejected.rejected,
        rejected_peer=rejected.policy,
        hit_share_of_ideal=hits / result.ideal_hit_rate if result.ideal_hit_rate > 0 else 1.0,
    )


def by_cell(jobs: Sequence[JobResult]) -> dict[Cell, list[JobResult]]:
    cells: dict[Cell, list[JobResult]] = {}
    for job in jobs:
        cells.setdefault(job.job.cell, []).append(job)
    return cells


def records(jobs: Sequence[JobResult]) -> list[dict[str, Any]]:
    """One record per cell and policy: the cell, the run's results, and its verdict against the best of the
    other peers (null when there are none)."""
    out = []
    for cell, runs in by_cell(jobs).items():
        results = [run.result for run in runs]
        for run in runs:
            judged = verdict(run.result, peers_of(run.result.policy, results))
            out.append(
                {
                    **asdict(cell),
                    "requests": run.requests,
                    "rate": run.rate,
                    "policy": run.result.policy,
                    **as_json(run.result),
                    "vs_best_peer": None if judged is None else {**asdict(judged), "missed": judged.missed},
                }
            )
    return out


def subject_verdicts(jobs: Sequence[JobResult]) -> dict[Cell, Verdict]:
    """kvroute's verdict in every cell that ran it and a peer."""
    verdicts = {}
    for cell, runs in by_cell(jobs).items():
        results = [run.result for run in runs]
        subject = next((r for r in results if r.policy == SUBJECT), None)
        judged = None if subject is None else verdict(subject, peers_of(SUBJECT, results))
        if judged is not None:
            verdicts[cell] = judged
    return verdicts


def table(title: str, jobs: Sequence[JobResult]) -> Table:
    """A row per cell: kvroute against the best peer per measure (the ratio and the peer's short name),
    then every policy's rejected count under its short name."""
    cells = by_cell(jobs)
    names = list(dict.fromkeys(run.result.policy for run in jobs))
    verdicts = subject_verdicts(jobs)
    legend = ", ".join(f"{SHORT[n]} {n}" for n in names if n in SHORT and SHORT[n] != n)
    view = Table(title=title, caption=f"last columns: each policy's rejected requests; {legend}")
    for column in (
        "workload",
        "inst",
        "load",
        "pool",
        "req",
        "ideal",
        "p50/best",
        "p99/best",
        "rej/best",
        "hit/ideal",
        "missed",
        *(SHORT.get(n, n) for n in names),
    ):
        view.add_column(column, justify="left" if column in ("workload", "missed") else "right")
    for cell, runs in cells.items():
        results = {run.result.policy: run.result for run in runs}
        judged = verdicts.get(cell)
        ideal = runs[0].result.ideal_hit_rate
        head = [
            cell.workload,
            str(cell.instances),
            f"{cell.load:g}",
            "on" if cell.pool else "off",
            str(runs[0].requests),
            f"{ideal:.0%}",
        ]
        if judged is None:
            ratios = ["-"] * 5
        else:
            ratios = [
                f"{judged.ttft_p50_ratio:.2f} {SHORT.get(judged.ttft_p50_peer, judged.ttft_p50_peer)}",
                f"{judged.ttft_p99_ratio:.2f} {SHORT.get(judged.ttft_p99_peer, judged.ttft_p99_peer)}",
                f"{judged.rejected}/{judged.peer_rejected}",
                f"{judged.hit_share_of_ideal:.0%}",
                " ".join(judged.missed) or "none",
            ]
        rejected = [str(results[n].rejected) if n in results else "-" for n in names]
        view.add_row(*head, *ratios, *rejected)
    return view


def summary(jobs: Sequence[JobResult]) -> dict[str, Any]:
    """Where kvroute meets all four targets and where not, with the cells and each target's misses."""
    verdicts = subject_verdicts(jobs)
    missing: Mapping[Cell, list[str]] = {cell: v.missed for cell, v in verdicts.items()}
    return {
        "cells": len(verdicts),
        "meets": [cell.label for cell, missed in missing.items() if not missed],
        "misses": {cell.label: missed for cell, missed in missing.items() if missed},
        "missed_by_target": {
            target: sum(target in missed for missed in missing.values())
            for target in ("p50", "p99", "rejected", "hit")
        },
    }


def summary_line(facts: Mapping[str, Any]) -> str:
    met, cells = len(facts["meets"]), facts["cells"]
    by_target = ", ".join(f"{target} in {count}" for target, count in facts["missed_by_target"].items())
    return (
        f"kvroute meets all four targets (p50 <= {P50_TARGET}x the best peer's, p99 <= the best peer's, "
        f"rejected <= the best peer's, hits >= {HIT_TARGET:.0%} of ideal) in {met} of {cells} cells; "
        f"misses {cells - met}: {by_target}"
    )


def flows_table(jobs: Sequence[JobResult]) -> Table | None:
    """The cells whose workload has flows (tenants): per policy, each flow's TTFT p50/p99, the interactive
    flow's p99 against what it gets alone, and the shares of the queue's dispatches while flows competed."""
    rows = [run for run in jobs if run.result.flows]
    if not rows:
        return None
    view = Table(title="tenants: TTFT by flow (interactive alone: the same requests without the batch flow)")
    for column in ("cell", "policy", "flow", "TTFT p50/p99", "p99 / alone", "dispatch share"):
        view.add_column(column, justify="left" if column in ("cell", "policy", "flow") else "right")
    for run in rows:
        flows = run.result.flows
        alone = flows.get("interactive-alone")
        for flow, figures in flows.items():
            if flow == "interactive-alone":
                continue
            versus = "-"
            if flow == "interactive" and alone is not None and alone["ttft_p99_s"] > 0:
                versus = f"{figures['ttft_p99_s'] / alone['ttft_p99_s']:.2f}"
            share = figures.get("backlogged_dispatch_share")
            view.add_row(
                run.job.cell.label,
                run.result.policy,
                flow,
                f"{figures['ttft_p50_s']:.2f}/{figures['ttft_p99_s']:.2f} s",
                versus,
                "-" if share is None else f"{share:.0%}",
            )
    return view
