"""What a benchmark shows while it runs: the results table so far and a progress bar for the running target.

On a terminal both redraw in place (rich ``Live``); elsewhere (CI logs, files) a line per target instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class BenchView(Protocol):
    def target(self, label: str, total: int) -> Callable[[], None]:
        """Announce a target; the returned callable is told after each of its requests."""

    def done(self, summary: str) -> None:
        """The running target finished; summary is one line (rich markup)."""


class _PlainView:
    def __init__(self, console: Console) -> None:
        self._console = console

    def target(self, label: str, total: int) -> Callable[[], None]:
        self._console.print(f"[bold]{label}[/]: {total} requests ...")
        return lambda: None

    def done(self, summary: str) -> None:
        self._console.print(f"  {summary}")


class _LiveView:
    def __init__(self, console: Console, table: Callable[[], RenderableType], live: Live) -> None:
        self._console, self._table, self._live = console, table, live
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )

    def target(self, label: str, total: int) -> Callable[[], None]:
        task = self._progress.add_task(label, total=total)
        self._redraw()
        return lambda: self._progress.advance(task)

    def done(self, summary: str) -> None:
        for task in self._progress.tasks:
            self._progress.update(task.id, visible=False)
        self._console.print(f"  {summary}")  # above the live area, so it stays in the scrollback
        self._redraw()

    def _redraw(self) -> None:
        self._live.update(Group(self._table(), self._progress), refresh=True)


@contextmanager
def bench_view(console: Console, table: Callable[[], RenderableType]) -> Iterator[BenchView]:
    """``table`` is called for the results so far each time a target starts or ends."""
    if not console.is_terminal:
        yield _PlainView(console)
        return
    with Live(console=console, refresh_per_second=4, transient=True) as live:
        yield _LiveView(console, table, live)
