"""How long a 1-token chat waits while `kvroute serve` takes in a large agent request, seen from outside.

Starts a simulated fleet (each instance a process of its own, as vLLM's are, or --fleet-processes 1: all in
one) and a router in front of it, sends 1-token chats one after another from a client thread, and meanwhile
sends large requests one at a time: a /v1/responses body of 20,000 function tools (1.5 MB) and a chat of
1.5 MB of words, both past the model's context, so that the engine refuses them after tokenizing. Prints the
large requests' answers and times, the chats' p50, p99 and longest, and the router's RSS before, just after
and once its allocator was trimmed (router/allocator.py: every 10 s).

    .venv/bin/python scripts/measure_large_request_stall.py --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvroute.processes import (  # noqa: E402
    FleetPorts,
    running_fleet,
    running_router_process,
    start,
    wait_healthy,
)

WORDS = "alpha beta gamma delta run tests fix the bug".split()
TOOLS = 20_000
CHAT_WORDS = 300_000


def post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def large_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, body) of each large request."""
    tools = [
        {
            "type": "function",
            "name": f"tool_{n}",
            "description": "one of many",
            "parameters": {"type": "object"},
        }
        for n in range(TOOLS)
    ]
    responses = {"model": "tiny-llama", "input": "hi", "tools": tools, "store": False}
    text = " ".join(WORDS[n % len(WORDS)] for n in range(CHAT_WORDS))
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return [
        ("responses, 20,000 tools", "/v1/responses", json.dumps(responses).encode()),
        ("chat of words", "/v1/chat/completions", json.dumps(chat).encode()),
    ]


@contextlib.contextmanager
def fleet(ports: FleetPorts, processes: int, log_dir: Path) -> Iterator[None]:
    if processes == 1:
        with running_fleet(ports, log_dir):
            yield
        return
    children = [start(f"fleet-{i}", ports.instance_args(i), log_dir) for i in range(ports.count)]
    try:
        for child, url in zip(children, ports.health_urls(), strict=True):
            wait_healthy(child, [url])
        yield
    finally:
        for child in children:
            child.stop()


def rss_mb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) // 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--fleet-processes", type=int, choices=(1, 0), default=0, help="1: one; 0: one each")
    parser.add_argument("--rounds", type=int, default=2, help="times each large request is sent")
    args = parser.parse_args()
    small = json.dumps(
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    bodies = large_bodies()
    print(", ".join(f"{name}: {len(body) / 1e6:.2f} MB" for name, _, body in bodies))
    ports = FleetPorts.allocate(args.instances)
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-stall-") as run_dir,
        fleet(ports, args.fleet_processes, Path(run_dir)),
    ):
        with running_router_process(ports.router_config(), Path(run_dir)) as (url, child):
            for _ in range(5):
                post(url + "/v1/chat/completions", small.encode())
            before = rss_mb(child.process.pid)
            waits: list[float] = []
            done = threading.Event()

            def probe() -> None:
                while not done.is_set():
                    started = time.monotonic()
                    post(url + "/v1/chat/completions", small.encode())
                    waits.append(time.monotonic() - started)
                    time.sleep(0.01)

            prober = threading.Thread(target=probe)
            prober.start()
            time.sleep(0.5)
            try:
                for _ in range(args.rounds):
                    for name, path, body in bodies:
                        started = time.monotonic()
                        status, answer = post(url + path, body)
                        took = time.monotonic() - started
                        print(f"{name}: {status} in {took:.2f} s: {answer[:90]!r}")
                time.sleep(0.5)
            finally:
                done.set()
                prober.join()
            after = rss_mb(child.process.pid)
            time.sleep(11)
            trimmed = rss_mb(child.process.pid)
    waits.sort()
    p99 = waits[max(0, round(len(waits) * 0.99) - 1)]
    print(
        f"1-token chats: {len(waits)}, p50 {statistics.median(waits) * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, "
        f"longest {waits[-1] * 1000:.1f} ms; router RSS {before} MB before, {after} MB after, {trimmed} MB "
        "11 s later"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
