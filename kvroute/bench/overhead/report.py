"""What ``kvroute bench overhead`` prints and draws: tables, the verdicts on its targets, PNG plots."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from kvroute.bench.overhead.grid import CellResult
from kvroute.bench.overhead.long import LongResult, LongSummary
from kvroute.bench.overhead.profiler import CellProfile
from kvroute.bench.overhead.streaming import StreamResult
from kvroute.bench.overhead.targets import PLAIN_PROXY

KVROUTE = "kvroute:kvroute"
VLLM_RR = "vllm-router:round_robin"
VLLM_KV = "vllm-router:kv_aware"
ENVOY_EPP = "envoy-epp:kvroute"


@dataclass
class Verdict:
    name: str
    goal: str
    value: str
    met: bool | None  # None: not measured in this run


def _num(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def grid_table(results: Sequence[CellResult]) -> Table:
    table = Table(title="router overhead: wrk against nginx (canned completion)")
    columns = (
        "target",
        "c",
        "body",
        "prompt",
        "req/s",
        "p50 ms",
        "p99 ms",
        "+p50 ms",
        "+p99 ms",
        "x direct",
        "x vllm-rr",
        "CPU ms/1k req",
        "of it, picker",
        "RSS MiB",
        "errors",
    )
    for column in columns:
        table.add_column(column, no_wrap=True)
    for r in results:
        table.add_row(
            r.target,
            str(r.concurrency),
            _size(r.size_bytes),
            r.prompt,
            f"{r.requests_per_s:,.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            _num(r.added_p50_ms),
            _num(r.added_p99_ms),
            _num(r.throughput_vs_direct),
            _num(r.throughput_vs_vllm_router),
            _num(r.cpu_ms_per_1k, ",.0f"),
            _num(r.helpers_cpu_ms_per_1k, ",.0f"),
            _num(r.peak_rss_mib, ".0f"),
            r.failed[:40] if r.failed else str(r.errors),
        )
    return table


def long_table(summaries: Sequence[LongSummary]) -> Table:
    table = Table(title="long prompts: latency of an agent turn, and what the router adds over the backend")
    for column in ("target", "tokens", "turn 1 ms", "later turns ms", "turn 1 +ms", "later turns +ms"):
        table.add_column(column, no_wrap=True)
    for s in summaries:
        table.add_row(
            s.target,
            f"{s.tokens:,}",
            _num(s.first_turn_ms, ".1f"),
            _num(s.later_turns_ms, ".1f"),
            _num(s.first_turn_added_ms, ".1f"),
            _num(s.later_turns_added_ms, ".1f"),
        )
    return table


def streaming_table(results: Sequence[StreamResult]) -> Table:
    table = Table(title="streaming: relayed tokens/s, time to first byte (TTFB), inter-token latency (ITL)")
    columns = (
        "target",
        "streams",
        "tokens/s",
        "x vllm\nrr",
        "TTFB ms\np50 / p99",
        "+TTFB ms\np50 / p99",
        "ITL ms\np50 / p99",
        "+ITL ms\np50 / p99",
        "router\ncores",
        "CPU ms /\n1k tok",
        "engine /\nclient cores",
        "failed",
    )
    for column in columns:
        table.add_column(column, no_wrap=True)
    for r in results:
        table.add_row(
            r.target,
            str(r.concurrency),
            f"{r.tokens_per_s:,.0f}",
            _num(r.tokens_per_s_vs_vllm_router),
            _pair(r.ttfb_p50_ms, r.ttfb_p99_ms),
            _pair(r.added_ttfb_p50_ms, r.added_ttfb_p99_ms),
            _pair(r.itl_p50_ms, r.itl_p99_ms),
            _pair(r.added_itl_p50_ms, r.added_itl_p99_ms),
            _num(r.router_cores),
            _num(r.cpu_ms_per_1k_tokens, ",.0f"),
            f"{r.engine_cores:.2f} / {r.client_cores:.2f}",
            f"{r.failed_streams} {r.errors[:30]}".strip(),
        )
    return table


def stages_table(profiles: Sequence[CellProfile], results: Sequence[CellResult]) -> Table:
    """Where each profiled cell's router CPU goes: the user CPU a request took in the cell's own (unprofiled)
    runs, by stage (profiler.STAGES, each its share of the samples outside system calls), and the system
    CPU."""
    table = Table(
        title="where a request's router CPU goes (user CPU by py-spy's samples; system CPU measured)"
    )
    for column in ("cell", "stage", "CPU ms a request", "share"):
        table.add_column(column, justify="left" if column in ("cell", "stage") else "right")
    for profile in profiles:
        key = (profile.target, profile.concurrency, profile.size_bytes, profile.prompt)
        measured = next((r for r in results if _key(r) == key), None)
        user_ms = system_ms = None
        if measured is not None and measured.cpu_ms_per_1k and measured.system_cpu_ms_per_1k is not None:
            system_ms = measured.system_cpu_ms_per_1k / 1000
            user_ms = measured.cpu_ms_per_1k / 1000 - system_ms
        cell = f"{profile.target} c={profile.concurrency} {_size(profile.size_bytes)} {profile.prompt}"
        for stage in profile.stages:
            ms = None if user_ms is None else stage.share * user_ms
            table.add_row(cell, stage.stage, _num(ms, ".3f"), f"{stage.share:.0%} of the user CPU")
            cell = ""
        if user_ms is not None and system_ms is not None:
            share = f"{system_ms / (user_ms + system_ms):.0%} of the whole"
            table.add_row(
                cell, "the kernel: system calls (sockets' reads and writes)", f"{system_ms:.3f}", share
            )
    return table


def _key(result: CellResult) -> tuple[str, int, int, str]:
    return result.target, result.concurrency, result.size_bytes, result.prompt


def _pair(a: float | None, b: float | None) -> str:
    return f"{_num(a)} / {_num(b)}"


def verdict_table(verdicts: Sequence[Verdict]) -> Table:
    table = Table(title="targets")
    for column in ("target", "goal", "measured", "met"):
        table.add_column(column)
    for v in verdicts:
        met = "n/a" if v.met is None else ("[green]met" if v.met else "[red]missed")
        table.add_row(v.name, v.goal, v.value, met)
    return table


def _size(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"


def _pairs(
    results: Sequence[CellResult], concurrency: int, mine: str = KVROUTE
) -> list[tuple[CellResult, CellResult]]:
    """(mine, vllm-router round_robin) in the same cell."""
    by_cell: dict[tuple[int, int, str], dict[str, CellResult]] = {}
    for r in results:
        if r.concurrency == concurrency and not r.failed:
            by_cell.setdefault((r.concurrency, r.size_bytes, r.prompt), {})[r.target] = r
    return [(cell[mine], cell[VLLM_RR]) for cell in by_cell.values() if mine in cell and VLLM_RR in cell]


def _grid_verdicts(results: Sequence[CellResult], mine: str, suffix: str) -> list[Verdict]:
    ratios = [
        k.added_p50_ms / v.added_p50_ms
        for k, v in _pairs(results, 1, mine)
        if k.added_p50_ms is not None and v.added_p50_ms is not None and v.added_p50_ms > 0
    ]
    shares = [k.requests_per_s / v.requests_per_s for k, v in _pairs(results, 64, mine) if v.requests_per_s]
    return [
        Verdict(
            f"added p50 at c=1{suffix}",
            "<= 1.5x vllm-router round_robin's",
            _spread(ratios, "x"),
            None if not ratios else max(ratios) <= 1.5,
        ),
        Verdict(
            f"throughput at c=64{suffix}",
            ">= 0.5x vllm-router round_robin's",
            _spread(shares, "x"),
            None if not shares else min(shares) >= 0.5,
        ),
    ]


def verdicts(
    results: Sequence[CellResult], long: Sequence[LongSummary], streams: Sequence[StreamResult] = ()
) -> list[Verdict]:
    """Each target judged over every cell it applies to: met only if it holds in all of them. The plain
    pass-through, when measured, is judged by the grid's targets too: the floor under kvroute's requests."""
    out = _grid_verdicts(results, KVROUTE, "")
    if any(r.target == PLAIN_PROXY for r in results):
        out += _grid_verdicts(results, PLAIN_PROXY, f" ({PLAIN_PROXY}, the floor)")
    for field, label in (("first_turn_added_ms", "turn 1"), ("later_turns_added_ms", "later turns")):
        ratios = []
        for mine in (s for s in long if s.target == KVROUTE):
            theirs = next((s for s in long if s.target == VLLM_KV and s.tokens == mine.tokens), None)
            a = getattr(mine, field)
            b = None if theirs is None else getattr(theirs, field)
            if a is not None and b is not None and b > 0:
                ratios.append(a / b)
        out.append(
            Verdict(
                f"long-prompt decision, {label}",
                "faster than vllm-router kv_aware (ratio < 1)",
                _spread(ratios, "x"),
                None if not ratios else max(ratios) < 1,
            )
        )
    return out + _streaming_verdicts(streams)


def _streaming_verdicts(streams: Sequence[StreamResult]) -> list[Verdict]:
    """Envoy + kvroute epp against vllm-router round_robin at each concurrency."""
    pairs = []
    for mine in (s for s in streams if s.target == ENVOY_EPP and s.tokens_per_s > 0):
        theirs = next((s for s in streams if s.target == VLLM_RR and s.concurrency == mine.concurrency), None)
        if theirs is not None and theirs.tokens_per_s > 0:
            pairs.append((mine, theirs))
    shares = [m.tokens_per_s / t.tokens_per_s for m, t in pairs]
    itl = [
        (m.concurrency, m.added_itl_p99_ms, t.added_itl_p99_ms)
        for m, t in pairs
        if m.added_itl_p99_ms is not None and t.added_itl_p99_ms is not None
    ]
    # Added latencies near zero are noise either way: a router within 1 ms of vllm-router's meets it too.
    itl_met = [mine <= max(1.5 * theirs, theirs + 1.0) for _, mine, theirs in itl]
    return [
        Verdict(
            f"streaming relayed tokens/s ({ENVOY_EPP})",
            ">= 0.8x vllm-router round_robin's",
            _spread(shares, "x"),
            None if not shares else min(shares) >= 0.8,
        ),
        Verdict(
            f"streaming added ITL p99 ({ENVOY_EPP})",
            "<= 1.5x vllm-router round_robin's (or within 1 ms of it) at every concurrency",
            "; ".join(f"c={c}: {mine:.2f} vs {theirs:.2f} ms" for c, mine, theirs in itl) or "not measured",
            None if not itl else all(itl_met),
        ),
    ]


def _spread(values: Sequence[float], unit: str) -> str:
    if not values:
        return "not measured"
    return f"median {statistics.median(values):.2f}{unit} (range {min(values):.2f}-{max(values):.2f}{unit})"


def plot(results: Sequence[CellResult], long: Sequence[LongResult], out_dir: Path, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    targets = list(dict.fromkeys(r.target for r in results))
    cells = list(dict.fromkeys((r.size_bytes, r.prompt) for r in results))
    labels = [f"{_size(s)}\n{p}" for s, p in cells]
    for concurrency, metric, ylabel, name in (
        (1, "added_p50_ms", "added p50 latency over direct (ms)", "latency-c1"),
        (64, "requests_per_s", "requests/s", "throughput-c64"),
        (64, "cpu_ms_per_1k", "router CPU ms per 1,000 requests", "cpu-c64"),
    ):
        rows = {(r.target, r.size_bytes, r.prompt): r for r in results if r.concurrency == concurrency}
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        width = 0.8 / max(len(targets), 1)
        for t_index, target in enumerate(targets):
            values = [
                getattr(rows[(target, *cell)], metric) if (target, *cell) in rows else None for cell in cells
            ]
            if all(v is None for v in values):
                continue
            xs = [i + t_index * width for i in range(len(cells))]
            ax.bar(xs, [v or 0 for v in values], width, label=target)
        ax.set_xticks([i + width * (len(targets) - 1) / 2 for i in range(len(cells))], labels)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel}, concurrency {concurrency}")
        if metric != "added_p50_ms":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if long:
        written.append(_plot_long(long, out_dir / f"{prefix}-long-prompt.png"))
    return written


def _plot_long(long: Sequence[LongResult], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, later, title in ((axes[0], False, "turn 1 (cold)"), (axes[1], True, "later turns (median)")):
        for target in dict.fromkeys(r.target for r in long if r.added_ms is not None):
            sizes = sorted({r.tokens for r in long if r.target == target})
            values = []
            for size in sizes:
                added = [
                    r.added_ms
                    for r in long
                    if (r.target, r.tokens, r.turn > 0) == (target, size, later) and r.added_ms is not None
                ]
                values.append(statistics.median(added) if added else float("nan"))
            ax.plot([s / 1000 for s in sizes], values, marker="o", label=target)
        ax.set_title(title)
        ax.set_xlabel("prompt tokens (thousands)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("added latency over the backend (ms)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
