"""Active health checks of a large fleet: at most health.max_checks_per_s, the longest due first."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web

from router.config import parse_config
from router.metrics import RouterMetrics
from router.upstreams.health import HealthChecker
from router.upstreams.instances import Upstreams
from tests.support.fake_upstreams import healthy


def test_a_fleet_larger_than_max_checks_per_s_allows_is_checked_a_share_a_tick() -> None:
    """Two checks a tick (4 a second, a tick of 0.5 s): five instances never checked are checked two, two,
    then the last one, and none is checked again before its interval."""

    async def main() -> list[int]:
        app = web.Application()
        app.router.add_get("/health", healthy)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            for _ in range(5):
                await web.TCPSite(runner, "127.0.0.1", 0).start()
            urls = [f"http://127.0.0.1:{address[1]}" for address in runner.addresses]
            raw = {
                "models": [{"name": "m"}],
                "instances": [{"name": f"e{n}", "url": url} for n, url in enumerate(urls)],
                "health": {"interval_s": 60, "max_checks_per_s": 4},
            }
            config = parse_config(raw)
            fleet = Upstreams(config)
            checked = []
            async with aiohttp.ClientSession() as session:
                checker = HealthChecker(fleet, session, config.health, RouterMetrics())
                for _ in range(4):
                    await checker.check_due()
                    checked.append(sum(instance.checked for instance in fleet.instances))
            assert all(instance.healthy for instance in fleet.instances)
            return checked
        finally:
            with contextlib.suppress(Exception):
                await runner.cleanup()

    assert asyncio.run(main()) == [2, 4, 5, 5]
