"""/metrics formatted in a worker thread: the event loop is held only to collect what it changes itself (the
block index), requests are answered while thousands of series are formatted, and the text is the same."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import router.runtime
from kvroute.processes import free_port_block
from router.index.figures import IndexFigures
from router.index.index_metrics import IndexCollector
from router.metrics import RENDER_SWITCH_S, RouterMetrics
from tests.support import in_process
from tests.support.fake_upstreams import only_instance
from tests.support.waiting import eventually

SLOW_S = 1.5


class Slow(Collector):
    """A collector that takes SLOW_S to read (as formatting a large fleet's series does), counting its reads
    and the threads they were made in."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.armed = False  # registering reads it once: slow only when a test says so

    def collect(self) -> Iterable[Metric]:
        if self.armed:
            self.threads.append(threading.get_ident())
            time.sleep(SLOW_S)
        return [GaugeMetricFamily("kvroute_test_slow", "Slow to read", 1)]


class Threads(Collector):
    """Records the thread each read is made in."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.threads: list[int] = []

    def collect(self) -> Iterable[Metric]:
        self.threads.append(threading.get_ident())
        return [GaugeMetricFamily(self.name, "Where it was read", len(self.threads))]


def _figures() -> IndexFigures:
    return IndexFigures(entries=5, max_entries=10, by_owner=[("a", 0, (3, 1, 0)), ("b", 0, (1, 0, 0))])


def _without_process_series(text: bytes) -> list[str]:
    """The process_ series change between two reads (CPU seconds, memory)."""
    return [line for line in text.decode().splitlines() if "process_" not in line]


def test_a_render_off_the_loop_says_what_a_render_on_it_says() -> None:
    metrics = RouterMetrics()
    metrics.requests("kvroute", "a", "200", "m", "chat").inc()
    metrics.in_flight("a").set(2)
    metrics.ttft_observed("a").observe(0.2)
    metrics.register_on_loop(IndexCollector(_figures, lambda: {"a", "b"}))
    off_loop = asyncio.run(metrics.render_off_loop())
    assert 'kvroute_index_blocks{tier="gpu",vllm_instance="a"} 3.0' in off_loop.decode()
    assert _without_process_series(off_loop) == _without_process_series(metrics.render())


def test_what_the_loop_changes_is_read_on_the_loop_and_the_rest_in_a_thread() -> None:
    metrics = RouterMetrics()
    on_loop, anywhere = Threads("kvroute_test_on_loop"), Threads("kvroute_test_anywhere")
    metrics.register_on_loop(on_loop)
    metrics.registry.register(anywhere)
    asyncio.run(metrics.render_off_loop())
    loop_thread = threading.get_ident()  # asyncio.run's loop runs in this thread
    assert on_loop.threads[-1] == loop_thread
    assert anywhere.threads[-1] != loop_thread


def test_scrapes_while_a_render_is_in_flight_share_it() -> None:
    metrics = RouterMetrics()
    slow = Slow()
    metrics.registry.register(slow)
    slow.armed = True

    async def scrapes() -> list[bytes]:
        return await asyncio.gather(*(metrics.render_off_loop() for _ in range(3)))

    texts = asyncio.run(scrapes())
    assert len(slow.threads) == 1
    assert texts[0] == texts[1] == texts[2]


def test_the_loop_runs_while_a_slow_render_is_formatted() -> None:
    metrics = RouterMetrics()
    slow = Slow()
    metrics.registry.register(slow)
    slow.armed = True

    async def stalls_during_render() -> float:
        render = asyncio.ensure_future(metrics.render_off_loop())
        longest = 0.0
        while not render.done():
            before = time.monotonic()
            await asyncio.sleep(0.01)
            longest = max(longest, time.monotonic() - before)
        await render
        return longest

    assert asyncio.run(stalls_during_render()) < SLOW_S / 2


class SwitchInterval(Collector):
    """Records Python's thread switch interval whenever it is read (in the render's thread)."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def collect(self) -> Iterable[Metric]:
        self.seen.append(sys.getswitchinterval())
        time.sleep(0.05)  # overlapping the other metrics' render
        return [GaugeMetricFamily("kvroute_test_switch", "Switch interval", self.seen[-1])]


def test_a_render_hands_the_gil_back_soon_and_the_interval_comes_back_after_renders_that_overlap() -> None:
    before = sys.getswitchinterval()
    first, second = RouterMetrics(), RouterMetrics()
    seen = SwitchInterval(), SwitchInterval()
    first.registry.register(seen[0])
    second.registry.register(seen[1])
    seen[0].seen.clear()
    seen[1].seen.clear()  # registering read them once

    async def both() -> None:
        await asyncio.gather(first.render_off_loop(), second.render_off_loop())

    asyncio.run(both())
    assert seen[0].seen == seen[1].seen == [RENDER_SWITCH_S]
    assert sys.getswitchinterval() == before != RENDER_SWITCH_S


@contextlib.contextmanager
def _router_with(collector: Collector, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A router in this process whose metrics export collector too; yields its URL."""

    class WithCollector(RouterMetrics):
        def __init__(self) -> None:
            super().__init__()
            self.registry.register(collector)

    monkeypatch.setattr(router.runtime, "RouterMetrics", WithCollector)
    with in_process.serving(only_instance("nowhere", free_port_block(1))) as url:
        yield url


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:  # /health's 503: no instance answers here
        return error.code, error.read()


def test_health_is_answered_while_metrics_render(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = Slow()
    with _router_with(slow, monkeypatch) as url:
        slow.armed = True
        scraped: list[tuple[int, bytes]] = []
        scrape = threading.Thread(target=lambda: scraped.append(_get(url + "/metrics")))
        scrape.start()
        eventually(lambda: bool(slow.threads), what="the render to start")
        started = time.monotonic()
        status, _ = _get(url + "/health")
        answered_in = time.monotonic() - started
        scrape.join()
    assert status in (200, 503)
    assert answered_in < SLOW_S / 2, f"/health waited {answered_in:.2f} s for the render"
    assert scraped[0][0] == 200 and b"kvroute_test_slow 1.0" in scraped[0][1]


def test_a_scrape_naming_samples_gets_only_those_and_leaves_the_rest_unread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prometheus' name[] parameters: two samples' families from a router whose full exposition is slow."""
    slow = Slow()
    with _router_with(slow, monkeypatch) as url:
        slow.armed = True
        status, named = _get(url + "/metrics?name[]=process_cpu_seconds_total&name[]=kvroute_build_info")
        status_all, everything = _get(url + "/metrics")
    families = {line.split()[2] for line in named.decode().splitlines() if line.startswith("# TYPE")}
    assert (status, families) == (200, {"process_cpu_seconds_total", "kvroute_build_info"})
    assert status_all == 200 and b"kvroute_test_slow 1.0" in everything
    assert len(slow.threads) == 1  # read for the full scrape only


class Overlaps(Collector):
    """Records how many of its reads overlapped at most (each takes 0.2 s, in the render's thread)."""

    def __init__(self) -> None:
        self.reading = self.most = 0
        self._lock = threading.Lock()

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            self.reading += 1
            self.most = max(self.most, self.reading)
        time.sleep(0.2)
        with self._lock:
            self.reading -= 1
        return [GaugeMetricFamily("kvroute_test_overlaps", "Reads at once", self.most)]


def test_scrapes_naming_different_samples_render_one_after_another() -> None:
    metrics = RouterMetrics()
    overlaps = Overlaps()
    metrics.registry.register(overlaps)
    overlaps.most = 0  # registering read it once

    async def scrapes() -> list[bytes]:
        named = [frozenset({"kvroute_test_overlaps", f"kvroute_test_other_{n}"}) for n in range(3)]
        return await asyncio.gather(*(metrics.render_off_loop(names) for names in named))

    texts = asyncio.run(scrapes())
    assert overlaps.most == 1
    assert all(b"kvroute_test_overlaps " in text and b"process_" not in text for text in texts)


def test_a_named_scrape_reads_what_the_loop_changes_in_one_process_and_across_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The index's family, collected on the loop: named, it comes as in the whole text; in a worker of
    several, through the collector that merges every worker's, which names nothing when registered."""
    for workers_dir in (None, tmp_path):
        if workers_dir is not None:
            monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(workers_dir))
        metrics = RouterMetrics()
        metrics.register_on_loop(IndexCollector(_figures, lambda: {"a", "b"}))
        named = asyncio.run(metrics.render_off_loop(frozenset({"kvroute_index_blocks"}))).decode()
        blocks = [line for line in named.splitlines() if not line.startswith("#")]
        assert len(blocks) == 6 and all(line.startswith("kvroute_index_blocks{") for line in blocks), named
        assert 'kvroute_index_blocks{tier="gpu",vllm_instance="a"} 3.0' in blocks
