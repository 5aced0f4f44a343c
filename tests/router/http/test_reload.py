"""The configuration file's watch: a plain file edited or replaced, and a Kubernetes ConfigMap mount updated
as kubelet does it, each reload once; only the file's own directory is watched; a watch that fails starts
again, and SIGHUP reloads all along."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import watchfiles
import yaml

from router.config import parse_config
from router.metrics import RouterMetrics
from router.reload import Reloader
from router.runtime import Runtime

RAW: dict[str, Any] = {
    "models": [{"name": "tiny-llama"}],
    "instances": [{"name": "a", "url": "http://127.0.0.1:9"}],
}
# Well past the watch's 50 ms step: a second batch of events from one change would be in by then.
QUIET_S = 1.0


def content(label: str) -> str:
    return yaml.safe_dump(RAW) + f"# {label}\n"


def plain(directory: Path) -> Path:
    path = directory / "router.yaml"
    path.write_text(content("start"))
    return path


def edit(path: Path, text: str) -> None:
    path.write_text(text)


def replace(path: Path, text: str) -> None:
    """As editors save: a new file renamed over the old one."""
    new = path.with_name(f".{path.name}.swp")
    new.write_text(text)
    os.replace(new, path)


def configmap(directory: Path) -> Path:
    """directory as kubelet mounts a ConfigMap: config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>."""
    data = Path(tempfile.mkdtemp(prefix="..2024_01_01_00_00_00.", dir=directory))
    (data / "config.yaml").write_text(content("start"))
    os.symlink(data.name, directory / "..data")
    os.symlink("..data/config.yaml", directory / "config.yaml")
    return directory / "config.yaml"


def kubelet_update(path: Path, text: str) -> None:
    """kubelet's AtomicWriter: the new files in a new directory, ..data_tmp pointing there renamed over ..data,
    then the old directory removed. The file's own symlink never changes."""
    directory = path.parent
    data = Path(tempfile.mkdtemp(prefix="..2024_01_01_00_00_01.", dir=directory))
    (data / "config.yaml").write_text(text)
    old = os.readlink(directory / "..data")
    os.symlink(data.name, directory / "..data_tmp")
    os.rename(directory / "..data_tmp", directory / "..data")
    shutil.rmtree(directory / old)


@contextlib.asynccontextmanager
async def watched(path: Path, metrics: RouterMetrics | None = None) -> AsyncIterator[list[str]]:
    """A Reloader watching path; the list gets what the file held at each reload."""
    config = parse_config(RAW)
    metrics = metrics or RouterMetrics()
    seen: list[str] = []

    async def reload(trigger: str = "") -> dict[str, Any]:
        seen.append(await asyncio.to_thread(path.read_text))
        return {}

    runtime = Runtime(config)
    runtime.metrics = metrics
    reloader = Reloader(runtime, path)
    reloader.reload = reload  # type: ignore[method-assign]
    task = asyncio.create_task(reloader.watch())
    try:
        yield seen
        assert not task.done(), task.result()  # its exception fails the test
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def within(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def watching(path: Path, change: Callable[[Path, str], None], seen: list[str]) -> None:
    """Changes path until a reload shows the watch has begun (it may begin after the first changes)."""
    deadline = time.monotonic() + 15
    attempt, before = 0, len(seen)
    while not await within(lambda: len(seen) > before, 0.5):
        assert time.monotonic() < deadline, "no reload on changing the file"
        change(path, content(f"warm-up {attempt}"))
        attempt += 1
    await asyncio.sleep(QUIET_S)


@pytest.mark.parametrize(
    ("layout", "change"),
    [(plain, edit), (plain, replace), (configmap, kubelet_update)],
    ids=["edited", "replaced", "configmap-update"],
)
def test_a_change_of_the_file_reloads_once(
    tmp_path: Path, layout: Callable[[Path], Path], change: Callable[[Path, str], None]
) -> None:
    path = layout(tmp_path)

    async def run() -> list[str]:
        async with watched(path) as seen:
            await watching(path, change, seen)
            before = len(seen)
            change(path, content("the update"))
            assert await within(lambda: len(seen) > before, 10), "no reload on the update"
            await asyncio.sleep(QUIET_S)
            return seen[before:]

    assert asyncio.run(run()) == [content("the update")]


def test_other_files_in_the_directory_do_not_wake_the_watch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The router's log beside its configuration: each write woke the watch, whose INFO line was the next."""
    path = plain(tmp_path)

    async def run() -> None:
        async with watched(path) as seen:
            await watching(path, edit, seen)
            caplog.clear()
            for line in range(10):
                with (tmp_path / "router.log").open("a") as log:
                    log.write(f"line {line}\n")
                await asyncio.sleep(0.1)
            await asyncio.sleep(QUIET_S)

    with caplog.at_level(logging.INFO, logger="watchfiles"):
        asyncio.run(run())
    assert [r.getMessage() for r in caplog.records if r.name.startswith("watchfiles")] == []


def test_a_change_before_the_watch_began_is_reloaded(tmp_path: Path) -> None:
    """The file changed after the router read it and before its watch began (tokenizers load in between): the
    watch's first look reloads it rather than wait for the next change."""
    path = plain(tmp_path)
    changed = yaml.safe_dump({**RAW, "instances": [{"name": "a", "url": "http://127.0.0.1:10"}]})
    path.write_text(changed)

    async def run() -> list[str]:
        async with watched(path) as seen:
            assert await within(lambda: len(seen) == 1, 10), "the change was not reloaded"
            await asyncio.sleep(QUIET_S)
            return seen

    assert asyncio.run(run()) == [changed]


def _inotify_watches() -> int:
    """Directories this process watches with inotify."""
    count = 0
    for info in Path("/proc/self/fdinfo").iterdir():
        with contextlib.suppress(OSError):
            count += info.read_text().count("inotify wd:")
    return count


@pytest.mark.skipif(not Path("/proc/self/fdinfo").is_dir(), reason="counts inotify watches in Linux's /proc")
def test_only_the_files_own_directory_is_watched(tmp_path: Path) -> None:
    """A file in /etc, say, must not put a watch on every directory below it."""
    path = plain(tmp_path)
    for name in ("a", "b", "c/d", "c/e"):
        (tmp_path / name).mkdir(parents=True)
    before = _inotify_watches()

    async def run() -> int:
        async with watched(path) as seen:
            await watching(path, edit, seen)
            return _inotify_watches() - before

    assert asyncio.run(run()) == 1


def test_a_failed_watch_starts_again_and_sighup_reloads_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """watchfiles fails on a full inotify watch table or a directory that went; without its handler, the next
    SIGHUP would end the router."""
    path = plain(tmp_path)
    real = watchfiles.awatch
    calls: list[int] = []

    async def failing_once(*paths: Path, **options: Any) -> AsyncIterator[set[Any]]:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "OS file watch limit reached")
        async for changes in real(*paths, **options):
            yield changes

    monkeypatch.setattr(watchfiles, "awatch", failing_once)
    metrics = RouterMetrics()

    def failures() -> float:
        value = metrics.registry.get_sample_value(
            "kvroute_background_task_failures_total", {"task": "config-watch"}
        )
        return value or 0.0

    def handled() -> bool:
        return signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN, None)

    async def run() -> list[str]:
        async with watched(path, metrics) as seen:
            assert await within(lambda: failures() > 0 or (bool(calls) and not handled()), 10), "no watch"
            assert handled(), "SIGHUP's handler went with the failed watch"
            assert failures() == 1
            path.write_text(content("while no watch ran"))
            assert await within(lambda: len(seen) == 1, 10), "the watch did not start again"
            os.kill(os.getpid(), signal.SIGHUP)
            assert await within(lambda: len(seen) == 2, 10), "no reload on SIGHUP"
            await watching(path, edit, seen)  # the new watch sees changes
            return seen[:2]

    assert asyncio.run(run()) == [content("while no watch ran")] * 2
    assert len(calls) == 2
