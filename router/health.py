"""Active health checks: GET /health on every instance, marking it down after consecutive failures.

Healthy instances are checked every interval; instances that are down are probed more often, so that a
restarted engine takes traffic again within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from router.config import HealthConfig
from router.instances import Fleet, Instance
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

DOWN_PROBE_INTERVAL_S = 0.5


class HealthChecker:
    def __init__(
        self, fleet: Fleet, session: aiohttp.ClientSession, config: HealthConfig, metrics: RouterMetrics
    ) -> None:
        self._fleet, self._session, self._config, self._metrics = fleet, session, config, metrics
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._due: dict[str, float] = {}
        self.tick_s = min(config.interval_s, DOWN_PROBE_INTERVAL_S)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(i) for i in self._fleet.instances))

    async def check_due(self) -> None:
        now = time.monotonic()
        due = [i for i in self._fleet.instances if not i.checked or self._due.get(i.name, 0.0) <= now]
        await asyncio.gather(*(self._check(i) for i in due))

    async def _check(self, instance: Instance) -> None:
        try:
            async with self._session.get(instance.url + "/health", timeout=self._timeout) as response:
                ok = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        instance.checked = True
        if ok:
            if not instance.healthy:
                log.info("instance %s is healthy again", instance.name)
            instance.healthy, instance.failed_checks = True, 0
        else:
            instance.failed_checks += 1
            if instance.healthy and instance.failed_checks >= self._config.unhealthy_after:
                log.warning("instance %s failed %d health checks", instance.name, instance.failed_checks)
                instance.healthy = False
        self._schedule(instance)

    def mark_unreachable(self, instance: Instance) -> None:
        """Passive check: a request could not reach it; route around it until a check passes."""
        if instance.healthy:
            log.warning("instance %s is unreachable; routing around it", instance.name)
        instance.healthy = False
        self._schedule(instance)

    def _schedule(self, instance: Instance) -> None:
        interval = self._config.interval_s if instance.healthy else self.tick_s
        self._due[instance.name] = time.monotonic() + interval
        self._metrics.healthy(instance.name).set(1 if instance.healthy else 0)
