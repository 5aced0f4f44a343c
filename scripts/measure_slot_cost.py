"""What a strict limit in flight across replicas costs the router: a request of a limited flow takes its slot
on the store and gives it back (router/shared/slots.py). Measures the router process's CPU a request, with
1, 8 and 64 requests at once (those asking during a round share the next), against a local redis-server.

    .venv/bin/python scripts/measure_slot_cost.py
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import uvloop

from kvroute.store_servers import running_redis
from router.metrics import RouterMetrics
from router.shared.settings import SharedConfig
from router.shared.slots import SharedSlots
from router.shared.store import SharedStore

REQUESTS = 3000
FLOWS = 4


async def measure(url: str) -> None:
    slots = SharedSlots(SharedStore(SharedConfig(url=url, namespace="slot-cost"), RouterMetrics()), "a")
    for concurrency in (1, 8, 64):
        each = REQUESTS // concurrency

        async def requests(flow: str, each: int = each) -> None:
            for _ in range(each):
                assert await slots.take([(flow, REQUESTS)])
                await asyncio.sleep(0)
                slots.give_back([flow])

        flows = [f"flow:tenant-{n % FLOWS}" for n in range(concurrency)]
        await asyncio.gather(*(requests(flow) for flow in flows))  # warm
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(requests(flow) for flow in flows))
        await slots.settled()
        count = each * concurrency
        cpu_us = (time.process_time() - cpu) / count * 1e6
        wall_us = (time.perf_counter() - wall) / count * 1e6
        print(f"{concurrency:>3} at once: {cpu_us:.0f} us of CPU a request, {wall_us:.0f} us wall")


def main() -> None:
    with tempfile.TemporaryDirectory() as logs, running_redis(Path(logs)) as server:
        uvloop.run(measure(server.url))


if __name__ == "__main__":
    main()
