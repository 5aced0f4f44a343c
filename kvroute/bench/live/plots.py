"""PNG plots of a ``kvroute bench live`` report: TTFT distributions, and hit rates beside TTFT quantiles."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class PlottedResult(Protocol):
    target: str
    skipped: str
    ttft_ms: list[float]
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    local_hit_rate: float | None
    pool_hit_rate: float | None


def write_plots(results: Sequence[PlottedResult], title: str, stem: Path) -> list[Path]:
    """``<stem>-ttft.png`` and ``<stem>-hits.png``; returns their paths."""
    # Imported here: matplotlib is a bench extra, and `kvroute serve` (the image) imports this module.
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on CI machines
    ran = [r for r in results if not r.skipped and r.ttft_ms]
    stem.parent.mkdir(parents=True, exist_ok=True)
    return [_ttft_cdf(ran, title, Path(f"{stem}-ttft.png")), _hits(ran, title, Path(f"{stem}-hits.png"))]


def _ttft_cdf(results: Sequence[PlottedResult], title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for result in results:
        values = sorted(result.ttft_ms)
        shares = [(i + 1) / len(values) for i in range(len(values))]
        axes.step(values, shares, where="post", label=result.target)
    axes.set_xscale("log")
    axes.set_xlabel("TTFT (ms, log scale)")
    axes.set_ylabel("share of requests")
    axes.set_title(f"TTFT CDF\n{title}", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    return _save(figure, path)


def _hits(results: Sequence[PlottedResult], title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r.target for r in results]
    places = list(range(len(results)))
    local = [100 * (r.local_hit_rate or 0.0) for r in results]
    pool = [100 * (r.pool_hit_rate or 0.0) for r in results]
    hits.bar(places, local, label="local prefix cache")
    hits.bar(places, pool, bottom=local, label="pool (KV connector)")
    hits.set_ylabel("prompt tokens served from cache (%)")
    hits.set_ylim(0, 100)
    hits.legend(fontsize=8, loc="lower right")
    width = 0.4
    ttft.bar([p - width / 2 for p in places], [r.ttft_p50_ms or 0.0 for r in results], width, label="p50")
    ttft.bar([p + width / 2 for p in places], [r.ttft_p99_ms or 0.0 for r in results], width, label="p99")
    ttft.set_ylabel("TTFT (ms)")
    ttft.legend(fontsize=8)
    for axes in (hits, ttft):
        axes.set_xticks(places, names, rotation=25, ha="right", fontsize=8)
        axes.grid(True, axis="y", alpha=0.3)
    figure.suptitle(title, fontsize=9)
    return _save(figure, path)


def _save(figure: Figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
