"""What a /metrics scrape of a large fleet's series costs the router's other requests, from outside: a lone
`kvroute serve` configured with many instances (nothing answers at their addresses), `/health` asked every
2 ms for a while alone and then while `/metrics` is read five times a second; the latencies of both.

    python scripts/measure_scrape_stall.py --instances 2000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_requests_during_burst import summary

from kvroute.processes import free_port_block, running_router_process

_PROBE_EVERY_S = 0.002
_SCRAPE_EVERY_S = 0.2
_STARTED_S = 15.0  # start-up's checks of every instance, which are no part of what is measured


def _config(instances: int) -> dict[str, object]:
    addresses, events = free_port_block(instances), free_port_block(instances)
    return {
        "models": [{"name": "m", "tokenizer": "builtin:tiny-llama"}],
        "health": {"interval_s": 60},
        "load": {"scrape_interval_s": 60},
        "instances": [
            {
                "name": f"p{i}",
                "url": f"http://127.0.0.1:{addresses + i}",
                "events": f"tcp://127.0.0.1:{events + i}",
            }
            for i in range(instances)
        ],
    }


def _get(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        size = len(response.read())
    return time.perf_counter() - started, size


def _health_latencies(url: str, seconds: float) -> list[float]:
    latencies, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        latencies.append(_get(url + "/health")[0])
        time.sleep(_PROBE_EVERY_S)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as scratch,
        running_router_process(_config(args.instances), Path(scratch)) as (
            url,
            _,
        ),
    ):
        time.sleep(_STARTED_S)
        alone = _health_latencies(url, args.seconds / 2)
        during: list[float] = []
        probing = threading.Thread(target=lambda: during.extend(_health_latencies(url, args.seconds)))
        probing.start()
        scrapes = []
        while probing.is_alive():
            scrapes.append(_get(url + "/metrics"))
            time.sleep(_SCRAPE_EVERY_S)
        probing.join()
    took = statistics.median(seconds for seconds, _ in scrapes) * 1000
    size = scrapes[0][1]
    print(f"{args.instances} instances: /metrics {size:,} bytes, {took:.0f} ms (median of {len(scrapes)})")
    print(f"/health alone: {summary(alone)}")
    print(f"/health during scrapes: {summary(during)}")


if __name__ == "__main__":
    main()
