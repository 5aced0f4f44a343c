"""Active health checks: GET /health on every instance, marking it down after consecutive failures.

Healthy instances are checked every interval; instances that are down are probed more often, so that a
restarted engine takes traffic again within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import aiohttp
import msgspec

from router.bounded_read import read_at_most
from router.metrics import RouterMetrics
from router.upstreams.instances import Instance, Upstreams
from router.upstreams.settings import HealthConfig

log = logging.getLogger(__name__)

DOWN_PROBE_INTERVAL_S = 0.5
# A /v1/models answer: a card per model and adapter, a few hundred bytes each.
MAX_MODEL_CARDS_BYTES = 4 * 2**20


class _ModelCard(msgspec.Struct):
    id: str
    max_model_len: int | None = None
    root: str | None = None  # vLLM's --model (an adapter's: its path, with its base as parent)
    parent: str | None = None


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


class HealthChecker:
    def __init__(
        self, fleet: Upstreams, session: aiohttp.ClientSession, config: HealthConfig, metrics: RouterMetrics
    ) -> None:
        self._fleet, self._session, self._config, self._metrics = fleet, session, config, metrics
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._due: dict[str, float] = {}
        self.tick_s = min(config.interval_s, DOWN_PROBE_INTERVAL_S)
        self._per_tick = max(1, math.floor(config.max_checks_per_s * self.tick_s))

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(i) for i in self._fleet.instances))

    async def check_due(self) -> None:
        now = time.monotonic()
        due = [i for i in self._fleet.instances if not i.checked or self._due.get(i.name, 0.0) <= now]
        if len(due) > self._per_tick:  # a large fleet: the longest due now, the rest at later ticks
            due.sort(key=lambda i: self._due.get(i.name, 0.0) if i.checked else -math.inf)
            del due[self._per_tick :]
        await asyncio.gather(*(self._check(i) for i in due))

    async def _check(self, instance: Instance) -> None:
        try:
            async with self._session.get(instance.url + "/health", timeout=self._timeout) as response:
                ok = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        first = not instance.checked
        instance.checked = True
        if ok:
            if not instance.healthy:
                log.info("instance %s is healthy again", instance.name)
            # A new engine, or one back, may take other lengths; one whose first checks failed (still
            # loading) without being marked down yet has not said them either.
            came_up = first or not instance.healthy or not instance.cards_read
            instance.healthy, instance.failed_checks = True, 0
            if came_up:  # after it takes requests again: a slow answer here must not hold them back
                await self._read_model_cards(instance)
        else:
            instance.failed_checks += 1
            if instance.healthy and instance.failed_checks >= self._config.unhealthy_after:
                log.warning("instance %s failed %d health checks", instance.name, instance.failed_checks)
                instance.healthy = False
        self._schedule(instance)

    async def _read_model_cards(self, instance: Instance) -> None:
        """Its models' max_model_len, which /v1/models passes on (clients size their prompts by it), and each
        base model's root (vLLM's --model), where its tokenizer is looked for (model_tokenizers.py)."""
        try:
            async with self._session.get(
                instance.url + "/v1/models", headers=instance.headers, timeout=self._timeout
            ) as response:
                body = await read_at_most(response, MAX_MODEL_CARDS_BYTES)
            instance.cards_read = True  # it answered: asked again when it comes up again, not before
            if body is None:
                log.warning(
                    "%s: /v1/models answered more than %d bytes, not read",
                    instance.name,
                    MAX_MODEL_CARDS_BYTES,
                )
                return
            cards = msgspec.json.decode(body, type=_ModelList).data
        except (
            TimeoutError,
            aiohttp.ClientError,
            msgspec.DecodeError,
            msgspec.ValidationError,
            UnicodeDecodeError,
        ) as exc:
            log.debug("no model cards from %s: %r", instance.name, exc)
            return
        instance.max_model_len = {c.id: c.max_model_len for c in cards if c.max_model_len is not None}
        instance.roots = {c.id: c.root for c in cards if c.root and c.parent is None}

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
