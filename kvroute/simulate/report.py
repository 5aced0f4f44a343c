"""Results of `kvroute bench simulate`: the table, the JSON, the plots."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from kvroute.simulate.results import RunResult


def table(title: str, results: Sequence[RunResult]) -> Table:
    view = Table(title=title)
    disaggregated = any(r.pd_paths for r in results)
    programs = any(r.programs for r in results)
    for column in (
        "policy",
        "TTFT p50/p99",
        "ITL p50/p99",
        "e2e p50/p99",
        "req/s",
        "hit local/pool",
        "ideal",
        "imbalance",
        "rejected/failed/retried/preempted",
        *(["disaggregated/skipped/fallback", "fetched"] if disaggregated else []),
        *(["sessions done, /h", "recomputed after a tool call"] if programs else []),
        "slowest 1%: admit/queue/own",
        "wall",
    ):
        view.add_column(column, justify="left" if column == "policy" else "right")
    for r in results:
        paths = r.pd_paths
        view.add_row(
            r.policy,
            f"{r.ttft_p50_s:.2f}/{r.ttft_p99_s:.2f} s",
            f"{r.itl_p50_s * 1000:.0f}/{r.itl_p99_s * 1000:.0f} ms",
            f"{r.e2e_p50_s:.1f}/{r.e2e_p99_s:.1f} s",
            f"{r.throughput_rps:.2f}",
            f"{r.local_hit_rate:.1%}/{r.pool_hit_rate:.1%}",
            f"{r.ideal_hit_rate:.1%}",
            f"{r.load_imbalance:.2f}",
            f"{r.rejected}/{r.failed}/{r.retried}/{r.preemptions}",
            *(
                [
                    "/".join(str(paths.get(p, 0)) for p in ("disaggregated", "skipped", "fallback")),
                    f"{r.transferred_rate:.1%}",
                ]
                if disaggregated
                else []
            ),
            *(_program_cells(r.programs) if programs else []),
            _tail_cell(r.tail),
            f"{r.wall_s:.0f} s",
        )
    return view


def _program_cells(programs: dict[str, float]) -> list[str]:
    if not programs:
        return ["-", "-"]
    done = f"{programs['sessions_completed']:.0f}, {programs['sessions_per_hour']:.0f}"
    recomputed = f"{programs['tool_call_recompute']:.1%}"
    if programs.get("warm_ups"):
        recomputed += f", {programs['warm_ups']:.0f} warm-ups"
    return [done, recomputed]


def _tail_cell(tail: dict[str, float]) -> str:
    if not tail:
        return "-"
    return f"{tail['admission_wait_s']:.2f}/{tail['queued_s']:.2f}/{tail['own_prefill_s']:.2f} s"


def as_json(result: RunResult) -> dict[str, Any]:
    return {
        **result.summary(),
        "tpot_p50_s": result.tpot_p50_s,
        "tpot_p99_s": result.tpot_p99_s,
        "transferred_rate": result.transferred_rate,
        "pd_paths": result.pd_paths,
        "completed": result.completed,
        "utilization": result.utilization,
        "requests_per_instance": result.requests_per_instance,
        "busy_per_instance_s": result.busy_per_instance_s,
        "longest_session_s": result.longest_session_s,
        "tail": result.tail,
        "flows": result.flows,
        "programs": result.programs,
        "wall_s": result.wall_s,
    }


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def plot_policies(path: Path, title: str, results: Sequence[RunResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in results]
    positions = range(len(names))
    figure, (latency, hits) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.4
    latency.bar([p - width / 2 for p in positions], [r.ttft_p50_s for r in results], width, label="TTFT p50")
    latency.bar([p + width / 2 for p in positions], [r.ttft_p99_s for r in results], width, label="TTFT p99")
    latency.set_ylabel("seconds")
    latency.set_yscale("log")
    latency.set_title("time to first token")
    hits.bar(positions, [r.local_hit_rate for r in results], label="local hits")
    hits.bar(
        positions,
        [r.pool_hit_rate for r in results],
        bottom=[r.local_hit_rate for r in results],
        label="pool hits",
    )
    if results:
        hits.axhline(results[0].ideal_hit_rate, color="black", linestyle="--", label="one infinite cache")
    hits.set_ylabel("share of prompt tokens")
    hits.set_title("prefix cache hits")
    for axes in (latency, hits):
        axes.set_xticks(list(positions), names, rotation=30, ha="right")
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_sweep(
    path: Path, title: str, xlabel: str, points: Mapping[str, Sequence[tuple[float, RunResult]]], slo_s: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft, hits) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, series in points.items():
        xs = [x for x, _ in series]
        ttft.plot(xs, [r.ttft_p99_s for _, r in series], marker="o", label=name)
        hits.plot(xs, [r.local_hit_rate for _, r in series], marker="o", label=name)
    ttft.axhline(slo_s, color="black", linestyle="--", label=f"SLO {slo_s:g} s")
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT p99 (s)")
    hits.set_ylabel("local hit rate (the pool serves the rest of the hits)")
    for axes in (ttft, hits):
        axes.set_xlabel(xlabel)
        axes.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
