"""One way to run background loops: repeat, count and log failures, back off, stop cleanly on cancel."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

from router.metrics import Family

log = logging.getLogger(__name__)


async def supervise(
    name: str,
    iteration: Callable[[], Awaitable[None]],
    interval_s: float,
    failures: Family[Counter],
    max_backoff_s: float = 30.0,
    first_delay: bool = False,
) -> None:
    """Run iteration every interval_s; after a failure wait twice as long, up to max_backoff_s.

    first_delay: wait one interval before the first run (the caller has just done one itself).
    """
    delay = interval_s
    if first_delay:
        await asyncio.sleep(interval_s)
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            await iteration()
            delay = interval_s
        except asyncio.CancelledError:
            raise
        except Exception:
            failures(name).inc()
            # A long-running iteration (a subscriber's session) that ends in failure starts over from the
            # base interval: backing off is for failures that come one after another.
            if loop.time() - started > max_backoff_s:
                delay = interval_s
            log.exception("background task %s failed; retrying in %.1fs", name, delay)
            delay_now, delay = delay, min(max(delay, interval_s) * 2, max_backoff_s)
            await asyncio.sleep(delay_now)
            continue
        await asyncio.sleep(delay)
