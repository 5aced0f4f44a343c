"""A measurement, not a test: clients in a closed loop against `kvroute serve --workers 2` in front of the
simulated fleet, one worker SIGKILLed mid-storm; what failed, when, and what waited for the successor.

    .venv/bin/python -m tests.scenarios.worker_storm --runs 3

Each request is on a connection of its own (one in four streamed), so that the kernel places new connections
all along. A failure that began before the kill was in flight in the killed worker, or in its accept queue.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvroute.processes import FleetPorts, free_port_block, running_fleet, start, wait_healthy
from tests.support.signalling import WORKER, children
from tests.support.waiting import eventually


@dataclass(frozen=True)
class _Request:
    began: float
    ended: float
    outcome: str  # "ok", or what went wrong
    worker: int | None


def _one(port: int, i: int) -> tuple[str, int | None]:
    stream = i % 4 == 0
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": f"storm {i} " + "word " * 50}],
        "max_tokens": 32 if stream else 4,
        "stream": stream,
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}
        )
        response = connection.getresponse()
        worker, data = response.getheader(WORKER), response.read()
        if response.status != 200:
            return f"status {response.status}", None
        if stream and not data.rstrip().endswith(b"data: [DONE]"):
            return "stream cut", None
        return "ok", None if worker is None else int(worker)
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__, None
    finally:
        connection.close()


def _storm(port: int, pool: int, clients: int, duration_s: float, kill_at_s: float) -> dict[str, object]:
    requests: list[_Request] = []
    lock, numbers = threading.Lock(), iter(range(1 << 40))
    start_at = time.monotonic()

    def client() -> None:
        while (began := time.monotonic() - start_at) < duration_s:
            outcome, worker = _one(port, next(numbers))
            with lock:
                requests.append(_Request(began, time.monotonic() - start_at, outcome, worker))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(kill_at_s)
    before = children(pool)
    os.kill(min(before), signal.SIGKILL)
    killed = time.monotonic() - start_at
    for thread in threads:
        thread.join()
    successors = {r.worker for r in requests if r.worker is not None} - before
    first = min((r.ended for r in requests if r.worker in successors), default=None)
    # Answered by the successor, begun before it served: they waited in the dead worker's queue.
    waited = [r for r in requests if r.worker in successors and first is not None and r.began < first - 0.5]
    return {
        "requests": len(requests),
        "outcomes": dict(collections.Counter(r.outcome for r in requests)),
        "failed, began s after the kill": [round(r.began - killed, 3) for r in requests if r.outcome != "ok"],
        "successor's first answer, s after the kill": None if first is None else round(first - killed, 2),
        "answered by the successor after waiting, began s after the kill": [
            round(r.began - killed, 3) for r in waited
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=14.0, help="seconds of storm per run")
    parser.add_argument("--kill-at", type=float, default=4.0, help="seconds into the storm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="worker-storm-") as logs:
        log_dir = Path(logs)
        ports = FleetPorts.allocate(3)
        with running_fleet(ports, log_dir, ["--prefill-tps", "200000", "--decode-tps", "1000"]):
            config = log_dir / "pool.yaml"
            config.write_text(yaml.safe_dump(ports.router_config()))
            for run in range(args.runs):
                print(json.dumps({"run": run, **_run(config, log_dir, run, args)}), flush=True)


def _run(config: Path, log_dir: Path, run: int, args: argparse.Namespace) -> dict[str, object]:
    port = free_port_block(1)
    child = start(
        f"pool-{run}", ["serve", "--config", str(config), "--port", str(port), "--workers", "2"], log_dir
    )
    try:
        wait_healthy(child, [f"http://127.0.0.1:{port}/health"])
        eventually(lambda: "2 workers serving on" in child.log_path.read_text(), 60, "both serving")
        return _storm(port, child.process.pid, args.clients, args.duration, args.kill_at)
    finally:
        child.stop()


if __name__ == "__main__":
    main()
