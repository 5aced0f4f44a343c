"""The runs behind `kvroute bench simulate`: one comparison of policies, or a sweep, with progress."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvroute.simulate import report
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.registry import policies_for
from kvroute.simulate.results import RunResult
from kvroute.simulate.simulation import simulate
from kvroute.traces import Trace


def rate_for_load(blocks: TraceBlocks, fleet: FleetSpec, load: float, ideal: float) -> float:
    """The rate multiplier at which the prefill a perfect router could not avoid (the ideal cache's
    misses) takes `load` of the fleet's prefill capacity."""
    requests, engine = blocks.trace.requests, fleet.engine
    duration_s = max(blocks.trace.duration_s, 1e-9)
    misses_per_s = sum(r.input_tokens for r in requests) / duration_s * (1.0 - ideal)
    if engine.attention_s_per_pair:  # their attention too, as the flat tokens that take as long
        attention_s = sum(
            engine.attention_s(hits, request.input_tokens - hits)
            for request, hits in zip(requests, blocks.ideal_hits, strict=True)
        )
        misses_per_s += attention_s * engine.prefill_tokens_per_s / duration_s
    capacity = fleet.instances * engine.prefill_tokens_per_s
    return load * capacity / misses_per_s


def ttft_floor(blocks: TraceBlocks, fleet: FleetSpec) -> dict[str, float]:
    """TTFT p50 and p99 if every request ran alone on an idle instance holding everything the trace computed
    before it (one infinite shared cache): its own prefill and nothing else. No router gets below it."""
    engine = fleet.engine
    seconds = [
        engine.prefill_s(hits, request.input_tokens - hits)  # the first token ends the last prefill step
        for request, hits in zip(blocks.trace.requests, blocks.ideal_hits, strict=True)
    ]
    return {"p50_s": float(np.percentile(seconds, 50)), "p99_s": float(np.percentile(seconds, 99))}


def offered_load(blocks: TraceBlocks, fleet: FleetSpec, rate: float, ideal: float) -> float:
    return rate / rate_for_load(blocks, fleet, 1.0, ideal)


class Bench:
    def __init__(self, fleet: FleetSpec, policies: Sequence[str], out: Path, tie_seed: int = 0) -> None:
        self.fleet, self.policies, self.out, self.tie_seed = fleet, list(policies), out, tie_seed
        self.console = Console(width=160)

    def _runs(
        self, label: str, blocks: TraceBlocks, fleet: FleetSpec, ideal: float, progress: Progress
    ) -> list[RunResult]:
        results = []
        total = len(blocks.trace.requests)
        for name in self.policies:
            task = progress.add_task(f"{label} {name}", total=total)
            make = policies_for(fleet)[name]
            result = simulate(
                blocks,
                fleet,
                make(fleet),
                ideal,
                tie_seed=self.tie_seed,
                progress=lambda n, task=task: progress.update(task, completed=n),  # type: ignore[misc]
            )
            progress.update(task, completed=total)
            results.append(result)
        return results

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )

    def _prepare(self, trace: Trace) -> tuple[TraceBlocks, float]:
        with self.console.status(f"hashing {len(trace.requests)} prompts of {trace.name} into blocks"):
            blocks = TraceBlocks(trace, self.fleet.engine.block_size)
            return blocks, blocks.ideal_hit_rate()

    def _document(self, trace: Trace, ideal: float, **extra: Any) -> dict[str, Any]:
        return {
            "trace": trace.name,
            "requests": len(trace.requests),
            "ideal_hit_rate": ideal,
            "setup": asdict(self.fleet),
            "tie_seed": self.tie_seed,
            **extra,
        }

    def compare(self, trace: Trace, rate: float | None, load: float) -> list[RunResult]:
        base, ideal = self._prepare(trace)
        rate = rate if rate is not None else rate_for_load(base, self.fleet, load, ideal)
        blocks = _rescaled(base, rate)
        floor = ttft_floor(base, self.fleet)
        pd = self.fleet.pd
        title = (
            f"{trace.name}: {len(trace.requests)} requests at x{rate:.2f} "
            f"(offered load {offered_load(base, self.fleet, rate, ideal):.2f}), {self.fleet.instances} "
            f"instances{f' ({pd.prefill} prefill, {pd.decode} decode)' if pd else ''}, "
            f"pool {'on' if self.fleet.pool else 'off'}"
            f"{', attention costs on' if self.fleet.engine.attention_s_per_pair else ''}; "
            f"TTFT floor p50 {floor['p50_s']:.2f} s, p99 {floor['p99_s']:.2f} s"
        )
        with self._progress() as progress:
            results = self._runs("", blocks, self.fleet, ideal, progress)
        self.console.print(report.table(title, results))
        document = self._document(
            trace,
            ideal,
            rate=rate,
            load=offered_load(base, self.fleet, rate, ideal),
            ttft_floor=floor,
            policies={r.policy: report.as_json(r) for r in results},
        )
        report.write_json(self.out / "results.json", document)
        report.plot_policies(self.out / "simulate-policies.png", title, results)
        self.console.print(
            f"results: {self.out / 'results.json'}, plot: {self.out / 'simulate-policies.png'}"
        )
        return results

    def sweep_rate(self, trace: Trace, loads: Sequence[float], slo_s: float) -> None:
        base, ideal = self._prepare(trace)
        points: dict[str, list[tuple[float, RunResult]]] = {name: [] for name in self.policies}
        with self._progress() as progress:
            for load in loads:
                rate = rate_for_load(base, self.fleet, load, ideal)
                for result in self._runs(
                    f"load {load:.1f}", _rescaled(base, rate), self.fleet, ideal, progress
                ):
                    points[result.policy].append((load, result))
        self._finish_sweep("rate", trace, ideal, points, slo_s, "offered load")

    def sweep_instances(self, trace: Trace, counts: Sequence[int], load: float, slo_s: float) -> None:
        base, ideal = self._prepare(trace)
        points: dict[str, list[tuple[float, RunResult]]] = {name: [] for name in self.policies}
        with self._progress() as progress:
            for count in counts:
                fleet = replace(self.fleet, instances=count)
                rate = rate_for_load(base, fleet, load, ideal)
                for result in self._runs(f"{count} instances", _rescaled(base, rate), fleet, ideal, progress):
                    points[result.policy].append((count, result))
        self._finish_sweep("instances", trace, ideal, points, slo_s, "instances")

    def _finish_sweep(
        self,
        kind: str,
        trace: Trace,
        ideal: float,
        points: dict[str, list[tuple[float, RunResult]]],
        slo_s: float,
        xlabel: str,
    ) -> None:
        for x in sorted({x for series in points.values() for x, _ in series}):
            results = [r for series in points.values() for px, r in series if px == x]
            self.console.print(report.table(f"{trace.name}, {xlabel} {x:g}", results))
        sustainable = {
            name: max((x for x, r in series if r.ttft_p99_s <= slo_s and r.rejected == 0), default=None)
            for name, series in points.items()
        }
        self.console.print(
            f"highest {xlabel} with TTFT p99 <= {slo_s:g} s and nothing rejected: {sustainable}"
        )
        series_json = {name: [{"x": x, **report.as_json(r)} for x, r in s] for name, s in points.items()}
        document = self._document(
            trace, ideal, sweep=kind, slo_s=slo_s, sustainable=sustainable, points=series_json
        )
        report.write_json(self.out / f"sweep-{kind}.json", document)
        report.plot_sweep(
            self.out / f"simulate-sweep-{kind}.png", f"{trace.name}: {xlabel} sweep", xlabel, points, slo_s
        )


def _rescaled(blocks: TraceBlocks, rate: float) -> TraceBlocks:
    """The same prompts (their hashed chains reused) arriving rate times as fast."""
    return blocks.with_trace(blocks.trace.with_rate(rate))
