"""The replicas' shared store: one Redis (or Valkey) client, and whether the store answers.

Every use of the store goes through here: an operation that fails (the store is unreachable or slower than
shared.timeout_s) is counted, marks the store down (an error log once, a warning on /health and /dashboard,
``kvroute_shared_store_up`` 0) and is given up, never retried under a request; the first that succeeds again
marks it up. While it is down each replica carries on with what it knows, as a router alone does.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as redis
from redis.exceptions import RedisError

from router.metrics import RouterMetrics
from router.shared.settings import SharedConfig

log = logging.getLogger(__name__)

StoreError = (RedisError, OSError, TimeoutError)


def redacted(url: str) -> str:
    """url without its password, for logs and warnings."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class SharedStore:
    def __init__(self, config: SharedConfig, metrics: RouterMetrics) -> None:
        assert config.url is not None
        self.config, self._metrics = config, metrics
        self.where = redacted(config.url)
        self.client = redis.Redis.from_url(
            config.url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry_on_timeout=False,
        )
        self.up = False
        self._down_since = time.monotonic()  # down until its first answer
        self._told = False  # the error log of this time down was written

    @property
    def known_down(self) -> bool:
        """Operations have failed, and none succeeded, for stale_after_s or longer: an outage, not a blip
        (nor a start where nothing has answered yet)."""
        down_s = time.monotonic() - self._down_since
        return not self.up and self._told and down_s >= self.config.stale_after_s

    def key(self, *parts: str) -> str:
        return ":".join((self.config.namespace, *parts))

    def answered(self) -> None:
        if self.up:
            return
        if self._told:
            log.warning("shared store %s answers again: replicas share their state", self.where)
        self.up, self._told = True, False
        self._metrics.shared_store_up.set(1)

    def dropped(self, operation: str) -> None:
        """An operation not made (too many waiting): counted, the store not marked down."""
        self._metrics.shared_store_errors(operation).inc()

    def failed(self, operation: str, error: BaseException) -> None:
        self._metrics.shared_store_errors(operation).inc()
        if self.up:
            self.up, self._down_since = False, time.monotonic()
            self._metrics.shared_store_up.set(0)
        if not self._told:
            self._told = True
            log.error(
                "shared store %s: %s failed (%s: %s): each replica carries on with what it knows until it "
                "answers again",
                self.where,
                operation,
                type(error).__name__,
                error,
            )

    def warnings(self) -> list[str]:
        if self.up:
            return []
        down_s = time.monotonic() - self._down_since
        return [
            f"shared store {self.where} unreachable for {down_s:.0f} s: replicas do not share load, limits "
            "or conversations"
        ]

    async def close(self) -> None:
        await self.client.aclose()
