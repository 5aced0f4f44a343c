"""`kvroute serve --workers 2` in front of the simulated fleet: both workers answer on one port, a session's
turns stay with its prefix's instance whichever worker routes them (the index host's one index knows each
worker's requests at once), /metrics sums every worker's requests whichever answers it and reports the one
index, a killed worker or index host is replaced without a request lost, and SIGTERM ends every process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvroute.processes import Child, FleetPorts, free_port_block, group_alive, start, wait_healthy
from tests.support.http import post
from tests.support.signalling import alive, children
from tests.support.waiting import eventually

WORKER = "x-kvroute-worker"
SYSTEM = "You are a careful coding agent working through a failing test suite, one file at a time. " * 8


@dataclass
class Served:
    child: Child
    url: str
    sent: int = 0  # requests answered 200 through it, which kvroute_requests_total must count

    def index_host(self) -> int:
        """The pool's index host: the last one it started."""
        return int(re.findall(r"the index host started: pid (\d+)", self.child.log_path.read_text())[-1])

    def workers(self) -> set[int]:
        """The pool's children that serve HTTP: all but its index host."""
        return children(self.child.process.pid) - {self.index_host()}


def start_workers(fleet: FleetPorts, log_dir: Path, name: str, **extra: object) -> Served:
    """`kvroute serve --workers 2` in its own process group (spawn's), its workers in it."""
    config = log_dir / f"{name}.yaml"
    config.write_text(yaml.safe_dump(fleet.router_config(**extra), sort_keys=False))
    port = free_port_block(1)
    child = start(name, ["serve", "--config", str(config), "--port", str(port), "--workers", "2"], log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(child, [url + "/health"])
        eventually(lambda: "2 workers serving on" in child.log_path.read_text())  # each one accepting
    except BaseException:
        child.stop()
        raise
    return Served(child, url)


@pytest.fixture(scope="module")
def served(fleet: FleetPorts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    running = start_workers(fleet, tmp_path_factory.mktemp("workers"), "workers")
    try:
        yield running
    finally:
        running.child.stop()


def chat(served: Served, messages: list[dict[str, str]], session: str | None = None) -> dict[str, str]:
    """The answer's headers; fails unless it is a 200."""
    body = json.dumps({"model": "tiny-llama", "messages": messages, "max_tokens": 4}).encode()
    status, headers, payload = post(
        served.url + "/v1/chat/completions", body, {"x-session-id": session} if session else {}
    )
    assert status == 200, payload
    served.sent += 1
    return {name.lower(): value for name, value in headers.items()}


def scrape(url: str) -> tuple[int, dict[str, float]]:
    """Which worker answered /metrics, and its samples by name and labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        worker, text = int(response.headers[WORKER]), response.read().decode()
    samples = {
        found.name + json.dumps(found.labels, sort_keys=True): float(found.value)
        for family in text_string_to_metric_families(text)
        for found in family.samples
    }
    return worker, samples


def requests_total(samples: dict[str, float]) -> float:
    return sum(value for key, value in samples.items() if key.startswith("kvroute_requests_total{"))


def _blocks_everywhere(served: Served, instance: str) -> set[float | None]:
    """How many blocks of instance each worker's index holds (asked until each has answered)."""
    key = "kvroute_index_blocks" + json.dumps({"tier": "gpu", "vllm_instance": instance}, sort_keys=True)
    held: dict[int, float | None] = {}
    for _ in range(50):
        worker, samples = scrape(served.url)
        held[worker] = samples.get(key)
        if set(held) == served.workers():
            break
    return set(held.values()) if set(held) == served.workers() else {None}


def _instances(served: Served) -> set[str]:
    return {
        json.loads("{" + key.partition("{")[2])["vllm_instance"]
        for key in scrape(served.url)[1]
        if key.startswith("kvroute_index_blocks{")
    }


def _most(held: set[float | None]) -> float:
    return max((n for n in held if n is not None), default=0.0)


def _same_index_everywhere(served: Served, instance: str, more_than: float) -> bool:
    """Whether every worker's index holds the same number of blocks of instance, more than before a turn
    (equal but stale, both would miss the turn's own blocks)."""
    held = _blocks_everywhere(served, instance)
    return len(held) == 1 and None not in held and held.pop() > more_than  # type: ignore[operator]


def test_both_workers_answer_and_sessions_keep_their_prefix_instance(served: Served) -> None:
    answered_by: set[int] = set()
    for session in range(4):
        messages = [{"role": "system", "content": f"Session {session}. {SYSTEM}"}]
        placed, routed_by = [], set()
        for turn in range(4):
            messages.append({"role": "user", "content": f"Turn {turn}: run tests/test_{turn}.py"})
            before = {at: _most(_blocks_everywhere(served, at)) for at in _instances(served)}
            headers = chat(served, messages, f"workers-{session}")
            placed.append(headers["x-kvroute-instance"])
            routed_by.add(int(headers[WORKER]))
            # The prefix, whichever worker routed the turns before: the host's index holds their speculative
            # entries from their routing on, before the engine's events come.
            if turn:
                assert int(headers["x-kvroute-cached-blocks"]) > 0, (
                    headers,
                    {k: v for k, v in scrape(served.url)[1].items() if "index" in k or "kv_" in k},
                )
            messages.append({"role": "assistant", "content": "Running them now."})
            # Every worker reports the host's index, which the engine's events grow.
            grown = before.get(placed[-1], 0.0)
            eventually(lambda at=placed[-1], n=grown: _same_index_everywhere(served, at, n))  # type: ignore[misc]
        assert len(set(placed)) == 1, placed
        answered_by |= routed_by
    with ThreadPoolExecutor(16) as pool:  # concurrent connections reach both workers
        for headers in pool.map(lambda i: chat(served, [{"role": "user", "content": f"hi {i}"}]), range(64)):
            answered_by.add(int(headers[WORKER]))
    assert answered_by == served.workers()


def test_requests_total_sums_every_worker_whichever_answers_the_scrape(served: Served) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: chat(served, [{"role": "user", "content": f"count {i}"}]), range(40)))
    scrapers: set[int] = set()
    deadline = time.monotonic() + 20
    while scrapers != served.workers():
        assert time.monotonic() < deadline, f"only {scrapers} answered /metrics"
        worker, samples = scrape(served.url)
        scrapers.add(worker)
        assert requests_total(samples) == served.sent, (worker, samples)
        assert samples["kvroute_peer_routers{}"] == 1  # each worker hears the other


def test_a_killed_worker_loses_no_later_request_and_is_replaced(served: Served) -> None:
    before = served.workers()
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    eventually(lambda: not alive(victim))
    # Once its pool has reaped it and steered new connections away (tests/scenarios/test_worker_faults.py checks
    # the connections that come in meanwhile: they wait for the successor).
    eventually(lambda: "exited with -9" in served.child.log_path.read_text())
    for i in range(20):  # the other worker takes every connection meanwhile
        assert int(chat(served, [{"role": "user", "content": f"after {i}"}])[WORKER]) != victim
    eventually(lambda: len(served.workers()) == 2 and victim not in served.workers())
    replacement = (served.workers() - before).pop()
    eventually(
        lambda: (
            replacement
            in {int(chat(served, [{"role": "user", "content": "new"}])[WORKER]) for _ in range(16)}
        )
    )
    _, samples = scrape(served.url)  # the dead worker's requests still count
    assert requests_total(samples) == served.sent
    assert "exited with -9; restarting it" in served.child.log_path.read_text()


def test_sigterm_drains_and_ends_every_process(fleet: FleetPorts, tmp_path: Path) -> None:
    running = start_workers(fleet, tmp_path, "terminated")
    try:
        processes = children(running.child.process.pid)  # the workers and the index host
        with ThreadPoolExecutor(1) as pool:
            body = {
                "model": "tiny-llama",
                "max_tokens": 1500,
                "stream": True,
                "messages": [{"role": "user", "content": "a long answer"}],
            }
            streamed = pool.submit(post, running.url + "/v1/chat/completions", json.dumps(body).encode())
            eventually(
                lambda: any(
                    value
                    for key, value in scrape(running.url)[1].items()
                    if key.startswith("kvroute_instance_in_flight")
                )
            )
            running.child.process.send_signal(signal.SIGTERM)
            status, _, payload = streamed.result(timeout=30)
        assert status == 200
        assert payload.rstrip().endswith(b"data: [DONE]")  # it finished within the grace period
        assert running.child.wait(30) == 0
        assert not [pid for pid in processes if alive(pid)]
        assert not group_alive(running.child.process.pid)
    finally:
        running.child.stop()


def test_a_bad_config_fails_fast_with_the_same_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("instances: []\nmodels: nope\n")

    def serve(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(bad), *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    alone, workers = serve(), serve("--workers", "2")
    assert workers.returncode == alone.returncode == 2
    assert workers.stderr == alone.stderr != ""


def test_an_index_host_lost_costs_prefix_knowledge_only_until_its_successor_holds_the_index(
    served: Served,
) -> None:
    messages = [{"role": "system", "content": f"Host. {SYSTEM}"}, {"role": "user", "content": "go"}]
    home = chat(served, messages, "host-session")["x-kvroute-instance"]
    victim = served.index_host()
    late = 'kvroute_index_host_lookups_total{"outcome": "late"}'
    late_before = scrape(served.url)[1].get(late, 0.0)
    os.kill(victim, signal.SIGSTOP)  # a host that answers nothing: each lookup waits its timeout, no longer
    try:
        for i in range(3):
            unknown = [
                {"role": "system", "content": f"Unknown {i}. {SYSTEM}"},
                {"role": "user", "content": "go"},
            ]
            assert int(chat(served, unknown)["x-kvroute-cached-blocks"]) == 0
    finally:
        os.kill(victim, signal.SIGKILL)
    eventually(lambda: served.index_host() != victim)
    # Its successor subscribes afresh and replays the engines' buffers: the session's prefix is known again,
    # once every worker is connected to it again (each worker's figures of the index are the host's).
    warm = f'kvroute_kv_warm{{"vllm_instance": "{home}"}}'
    eventually(lambda: scrape(served.url)[1].get(warm) == 1 and _same_index_everywhere(served, home, 0))
    headers = chat(served, messages, "host-session")
    _, samples = scrape(served.url)
    lookups = {key: value for key, value in samples.items() if key.startswith("kvroute_index_host_lookups")}
    assert headers["x-kvroute-instance"] == home, (headers, lookups)
    assert int(headers["x-kvroute-cached-blocks"]) > 0, (headers, lookups)
    assert lookups[late] - late_before == 3, lookups  # the three while it was stopped
