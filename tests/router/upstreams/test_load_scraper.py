"""The load scraper: vLLM's /metrics read by a targeted scan, engine load set on each instance, stale load cleared."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvroute.processes import Child, FleetPorts, free_port_block, running_fleet
from router.config import parse_config
from router.metrics import RouterMetrics
from router.supervisor import supervise
from router.upstreams.instances import Upstreams
from router.upstreams.load_scraper import (
    LoadScraper,
    parse_engine_load,
    parse_kv_capacity,
    parse_pool_load_rate,
    parse_start_time,
)
from router.upstreams.settings import LoadConfig
from scorers.candidate import EngineLoad
from tests.conftest import ManualClock

CAPTURE = Path(__file__).parents[2] / "fixtures" / "vllm" / "capture_int.json"


def captured_metrics(**values: str) -> bytes:
    """The /metrics body captured from vLLM, with the values of engine 0 of the named families replaced."""
    requests = json.loads(CAPTURE.read_text())["requests"]
    text = str(next(r for r in requests if r["name"] == "metrics")["text"]).encode()
    for name, value in values.items():
        head = f'vllm:{name}{{engine="0",model_name="tiny-llama"}} '.encode()
        start = text.index(head) + len(head)
        text = text[:start] + value.encode() + text[text.index(b"\n", start) :]
    return text


def exposition(
    waiting: tuple[str, ...] = ("0.0",),
    running: tuple[str, ...] = ("0.0",),
    usage: tuple[str, ...] = ("0.0",),
) -> bytes:
    """The three families, one sample per engine, with a look-alike family first (vLLM has it after)."""
    lines = []
    for name, values in [
        ("num_requests_waiting_by_reason", ("7.0",)),
        ("num_requests_running", running),
        ("num_requests_waiting", waiting),
        ("kv_cache_usage_perc", usage),
    ]:
        lines += [f"# HELP vllm:{name} help text", f"# TYPE vllm:{name} gauge"]
        lines += [f'vllm:{name}{{engine="{e}",model_name="tiny-llama"}} {v}' for e, v in enumerate(values)]
    return ("\n".join(lines) + "\n").encode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (captured_metrics(), EngineLoad(0.0, 0.0, 0.0)),
        (
            captured_metrics(
                num_requests_waiting="3.0", num_requests_running="2.0", kv_cache_usage_perc="0.25"
            ),
            EngineLoad(3.0, 2.0, 0.25),
        ),
        (captured_metrics(kv_cache_usage_perc="NaN"), None),
        (
            exposition(("1", "2"), ("3", "4"), ("0.2", "0.6")),
            EngineLoad(3.0, 7.0, 0.4),
        ),  # data parallel: sums, mean usage
        (exposition(("5",), ("1",), ("1e-1",)), EngineLoad(5.0, 1.0, 0.1)),
        (
            b'vllm:num_requests_waiting 2\nvllm:num_requests_running{a="x y}"} 1 1700000000000\nvllm:kv_cache_usage_perc 0.5',
            EngineLoad(2.0, 1.0, 0.5),
        ),  # first line, no labels, spaces and braces in labels, timestamp, no final newline
        (exposition(("NaN",)), None),
        (exposition(usage=("+Inf",)), None),
        (exposition(usage=("12.5",)), None),  # a percentage, not vLLM's fraction
        (exposition(usage=("1.0",)), EngineLoad(0.0, 0.0, 1.0)),
        (exposition(running=("-1",)), None),
        (exposition(("1", "two")), None),  # one bad engine spoils the round
        (exposition(usage=("",)), None),
        (exposition().replace(b"vllm:kv_cache_usage_perc{", b"vllm:kv_cache_usage{"), None),
        (
            exposition().replace(b"vllm:num_requests_waiting{", b"vllm:num_requests_waiting_total{"),
            None,
        ),  # only look-alikes
        (b"", None),
        (b"<html><body>502 Bad Gateway</body></html>", None),
        (bytes(range(256)) * 64, None),
        (b"vllm:num_requests_waiting\nvllm:num_requests_running{}\nvllm:kv_cache_usage_perc {", None),
    ],
)
def test_parse_engine_load(body: bytes, expected: EngineLoad | None) -> None:
    assert parse_engine_load(body) == expected


def one_instance_fleet(url: str) -> Upstreams:
    return Upstreams(parse_config({"models": [{"name": "m"}], "instances": [{"name": "a", "url": url}]}))


class FakeEngine:
    """An inline /metrics endpoint whose answer the test sets; it records the request headers."""

    def __init__(self) -> None:
        self.status, self.body, self.hang = 200, exposition(("2",), ("1",), ("0.5",)), False
        self.headers: list[dict[str, str]] = []
        self._release = asyncio.Event()

    async def metrics(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        if self.hang:
            await self._release.wait()
        return web.Response(status=self.status, body=self.body)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            self._release.set()
            await runner.cleanup()


@pytest.mark.parametrize(
    ("status", "body", "hang"),
    [
        (500, exposition(), False),
        (200, b"garbage", False),
        (200, exposition(("NaN",)), False),
        (200, exposition(), True),  # slower than timeout_s
    ],
)
def test_an_unusable_answer_keeps_the_last_load_until_it_is_stale(
    status: int, body: bytes, hang: bool
) -> None:
    async def main() -> list[EngineLoad | None]:
        engine, clock = FakeEngine(), ManualClock(1000.0)
        async with engine.serving() as url, aiohttp.ClientSession() as session:
            fleet = one_instance_fleet(url)
            scraper = LoadScraper(fleet, session, LoadConfig(timeout_s=0.2, stale_after_s=1.0), clock=clock)
            seen = []
            await scraper.scrape_all()
            seen.append(fleet.instances[0].load)
            engine.status, engine.body, engine.hang = status, body, hang
            for advance in (0.5, 0.5, 0.1):  # 0.5 and 1.0 s after the last good scrape: fresh; 1.1 s: stale
                clock.now += advance
                await scraper.scrape_all()
                seen.append(fleet.instances[0].load)
            engine.status, engine.body, engine.hang = 200, exposition(("4",), ("0",), ("0.75",)), False
            await scraper.scrape_all()
            seen.append(fleet.instances[0].load)
            assert all(h.get("Accept-Encoding") == "identity" for h in engine.headers)
            return seen

    first = EngineLoad(2.0, 1.0, 0.5)
    assert asyncio.run(main()) == [first, first, first, None, EngineLoad(4.0, 0.0, 0.75)]


def test_the_captured_body_has_the_servers_start_time() -> None:
    started = parse_start_time(captured_metrics())
    assert started is not None and started > 1.7e9


def with_start_time(body: bytes, seconds: float) -> bytes:
    """body with the server's process start time, as vLLM reports it."""
    return body + f"process_start_time_seconds {seconds}\n".encode()


def test_a_restart_is_a_later_start_time_after_a_silence() -> None:
    def started_at(seconds: float) -> bytes:
        return with_start_time(exposition(), seconds)

    async def main() -> list[str]:
        engine, restarts = FakeEngine(), []
        async with engine.serving() as url, aiohttp.ClientSession() as session:
            scraper = LoadScraper(
                one_instance_fleet(url), session, LoadConfig(timeout_s=0.5), restarted=restarts.append
            )
            # Two API server processes answer in turn: different start times, no silence, no restart.
            for seconds in (1000.0, 1005.0, 1000.0, 1005.0):
                engine.body = started_at(seconds)
                await scraper.scrape_all()
            engine.status = 500  # down ...
            await scraper.scrape_all()
            engine.status, engine.body = 200, started_at(1005.0)  # ... and back as the same process
            await scraper.scrape_all()
            assert restarts == []
            engine.status = 503
            await scraper.scrape_all()
            engine.status, engine.body = 200, started_at(2000.0)  # back as a new process
            await scraper.scrape_all()
            await scraper.scrape_all()
            return restarts

    assert asyncio.run(main()) == ["a"]


def test_an_engine_the_health_checks_found_down_is_not_asked_and_its_restart_is_seen_once_up() -> None:
    def started_at(seconds: float) -> bytes:
        return with_start_time(exposition(("2",), ("1",), ("0.5",)), seconds)

    async def main() -> tuple[list[int], list[EngineLoad | None], list[str]]:
        engine, clock, restarts = FakeEngine(), ManualClock(1000.0), []
        async with engine.serving() as url, aiohttp.ClientSession() as session:
            fleet = one_instance_fleet(url)
            scraper = LoadScraper(
                fleet, session, LoadConfig(stale_after_s=1.0), clock=clock, restarted=restarts.append
            )
            asked, loads = [], []
            engine.body = started_at(1000.0)
            for healthy, advance in ((True, 0.0), (False, 0.5), (False, 1.0), (True, 0.1)):
                fleet.instances[0].healthy = healthy
                clock.now += advance
                if not healthy:
                    engine.body = started_at(2000.0)  # it restarts while down
                await scraper.scrape_all()
                asked.append(len(engine.headers))
                loads.append(fleet.instances[0].load)
            return asked, loads, restarts

    asked, loads, restarts = asyncio.run(main())
    assert asked == [1, 1, 1, 2]  # not asked while down
    assert loads == [EngineLoad(2.0, 1.0, 0.5), EngineLoad(2.0, 1.0, 0.5), None, EngineLoad(2.0, 1.0, 0.5)]
    assert restarts == ["a"]


def test_an_instance_never_scraped_has_no_load() -> None:
    async def main() -> EngineLoad | None:
        async with aiohttp.ClientSession() as session:
            fleet = one_instance_fleet(f"http://127.0.0.1:{free_port_block(1)}")
            await LoadScraper(fleet, session, LoadConfig(timeout_s=0.5)).scrape_all()
            return fleet.instances[0].load

    assert asyncio.run(main()) is None


@pytest.fixture(scope="module")
def two_instances(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(2)
    with running_fleet(ports, tmp_path_factory.mktemp("load-fleet"), ["--decode-tps", "20"]):
        yield ports


@contextlib.asynccontextmanager
async def scraping(scraper: LoadScraper) -> AsyncIterator[None]:
    """The scraper running as the router runs it, under supervise."""
    failures = RouterMetrics().task_failures
    task = asyncio.create_task(supervise("load", scraper.scrape_all, scraper.interval_s, failures))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Seconds until condition held; fails after timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_load_and_kv_capacity_of_every_instance_are_scraped(two_instances: FleetPorts) -> None:
    async def main() -> list[tuple[EngineLoad | None, int | None]]:
        fleet = Upstreams(parse_config(two_instances.router_config()))
        async with aiohttp.ClientSession() as session:
            await LoadScraper(fleet, session, LoadConfig(timeout_s=1.0)).scrape_all()
        return [(i.load, i.kv_capacity_tokens) for i in fleet.instances]

    # the fleet's defaults: 2,048 blocks of 32 tokens
    assert asyncio.run(main()) == [(EngineLoad(0.0, 0.0, 0.0), 2048 * 32)] * 2


def cache_config_line(engine: int, blocks: str, block_size: str = "16") -> str:
    return (
        f'vllm:cache_config_info{{block_size="{block_size}",engine="{engine}",num_gpu_blocks="{blocks}",'
        f'num_gpu_blocks_override="1"}} 1.0'
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (captured_metrics(), 72 * 32),  # vLLM's: kv_cache_size_tokens="2304" beside it
        (
            ("# HELP x\n" + cache_config_line(0, "100") + "\n" + cache_config_line(1, "50") + "\n").encode(),
            150 * 16,
        ),  # data parallel: every engine's blocks
        (("# HELP x\n" + cache_config_line(0, "None") + "\n").encode(), None),  # before profiling
        (exposition(), None),  # no such family
    ],
)
def test_parse_kv_capacity(body: bytes, expected: int | None) -> None:
    assert parse_kv_capacity(body) == expected


def pool_loads(seconds: float, keys: float, status: str = "ok", engine: int = 0) -> str:
    """vLLM's Mooncake store connector's load_get samples, labelled as it labels them."""
    labels = f'model_name="tiny-llama",engine="{engine}",operation="load_get",status="{status}"'
    return (
        f"vllm:mooncake_store_operation_time_seconds_sum{{{labels}}} {seconds}\n"
        f"vllm:mooncake_store_operation_time_seconds_count{{{labels}}} 3.0\n"
        f"vllm:mooncake_store_operation_keys_total{{{labels}}} {keys}\n"
    )


def pool_body(*samples: str) -> bytes:
    put = 'vllm:mooncake_store_operation_keys_total{model_name="tiny-llama",engine="0",operation="put",status="ok"}'
    return ("# HELP x\n" + cache_config_line(0, "100") + f"\n{put} 999.0\n" + "".join(samples)).encode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (pool_body(pool_loads(0.32, 100.0)), 0.32 / 100 / 16),
        (pool_body(pool_loads(0.32, 100.0), pool_loads(5.0, 50.0, "partial_failure")), 0.32 / 100 / 16),
        (pool_body(pool_loads(0.1, 63.0)), None),  # too few keys to tell
        (pool_body(pool_loads(float("nan"), 100.0)), None),
        (pool_body(), None),  # no loads yet, or no connector
        (captured_metrics(), None),
        (pool_loads(0.32, 100.0).encode(), None),  # no block size
    ],
)
def test_parse_pool_load_rate(body: bytes, expected: float | None) -> None:
    rate = parse_pool_load_rate(body)
    assert rate == (None if expected is None else pytest.approx(expected))


def test_a_request_in_flight_shows_as_running_on_its_instance(two_instances: FleetPorts) -> None:
    async def main() -> tuple[EngineLoad | None, EngineLoad | None]:
        fleet = Upstreams(parse_config(two_instances.router_config()))
        busy, idle = fleet.instances[1], fleet.instances[0]
        body = {"model": "tiny-llama", "prompt": "hello " * 40, "max_tokens": 200, "stream": True}
        async with aiohttp.ClientSession() as session:
            scraper = LoadScraper(fleet, session, LoadConfig(scrape_interval_s=0.05, timeout_s=1.0))
            async with scraping(scraper), session.post(busy.url + "/v1/completions", json=body) as stream:
                assert stream.status == 200
                await stream.content.readline()  # the first token is out: the request runs for ~10 s
                await wait_until(lambda: busy.load is not None and busy.load.running >= 1)
                return busy.load, idle.load

    busy, idle = asyncio.run(main())
    assert busy is not None and busy.running == 1 and busy.waiting == 0 and 0 < busy.kv_usage <= 1
    assert idle == EngineLoad(0.0, 0.0, 0.0)


def test_the_load_of_a_stopped_instance_goes_stale(tmp_path: Path) -> None:
    ports = FleetPorts.allocate(1)

    async def main(child: Child) -> tuple[float, float]:
        fleet = Upstreams(parse_config(ports.router_config()))
        instance = fleet.instances[0]
        async with aiohttp.ClientSession() as session:
            scraper = LoadScraper(
                fleet, session, LoadConfig(scrape_interval_s=0.05, timeout_s=0.2, stale_after_s=0.5)
            )
            async with scraping(scraper):
                await wait_until(lambda: instance.load is not None)
                stopping = time.monotonic()  # the last good scrape was at most an interval before this
                await asyncio.to_thread(child.stop)
                stopped = time.monotonic()
                await wait_until(lambda: instance.load is None, timeout_s=5.0)
                return time.monotonic() - stopping, time.monotonic() - stopped

    with running_fleet(ports, tmp_path) as child:
        since_stopping, since_stopped = asyncio.run(main(child))
    assert since_stopping > 0.5 - 0.05  # what it said last held for stale_after_s
    assert since_stopped < 0.5 + 0.2 + 0.05 + 0.5  # stale_after_s, a timed-out scrape, an interval, slack


def test_a_fleet_larger_than_max_scrapes_per_s_allows_is_read_a_share_a_round_in_turn() -> None:
    """Five engines at two reads a round: each round reads the next two, every engine is read within three
    rounds, and a load goes stale after three times stale_after_s, as it is read three times as seldom."""

    async def main() -> None:
        engines, clock = [FakeEngine() for _ in range(5)], ManualClock(1000.0)
        config = LoadConfig(scrape_interval_s=1.0, max_scrapes_per_s=2.0, stale_after_s=1.0)
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(engine.serving()) for engine in engines]
            session = await stack.enter_async_context(aiohttp.ClientSession())
            raw = {
                "models": [{"name": "m"}],
                "instances": [{"name": f"e{n}", "url": u} for n, u in enumerate(urls)],
            }
            fleet = Upstreams(parse_config(raw))
            scraper = LoadScraper(fleet, session, config, clock=clock)
            reads = []
            for _ in range(3):
                await scraper.scrape_all()
                reads.append([len(engine.headers) for engine in engines])
                clock.now += 1.0
            assert reads == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [2, 1, 1, 1, 1]]
            assert all(instance.load is not None for instance in fleet.instances)
            engines[2].status = 500  # read again in the next round (engines 2 and 3), then every third
            for expected_fresh in (True, True, True, False):
                await scraper.scrape_all()
                assert (fleet.instances[2].load is not None) is expected_fresh
                clock.now += 1.0

    asyncio.run(main())
