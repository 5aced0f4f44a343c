"""Fixtures that start real processes: a simulated fleet and routers in front of it."""

from __future__ import annotations

import os
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.processes import PORT_RANGE_ENV, FleetPorts, running_fleet, running_router, server_ports
from router.prompt.tokenization import PromptTokenizer
from tests.support.scheduling import EnginesTogether, starts_engines
from tinymodel.builder import ensure_model

INSTANCES = 3


class ManualClock:
    """A clock for code that takes one (clock=...): it stands still until a test sets now."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(model_dir)


@pytest.fixture(scope="session")
def fleet_ports() -> FleetPorts:
    return FleetPorts.allocate(INSTANCES)


@pytest.fixture(scope="session")
def fleet(
    fleet_ports: FleetPorts, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetPorts]:
    # Small prefill/decode times keep the suite fast; the engine's timing has its own tests.
    args = ["--prefill-tps", "200000", "--decode-tps", "1000"]
    with running_fleet(fleet_ports, tmp_path_factory.mktemp("fleet"), args):
        yield fleet_ports


@pytest.fixture(scope="session")
def router_url(fleet: FleetPorts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_router(fleet.router_config(), tmp_path_factory.mktemp("router")) as url:
        yield url


def instance_url(ports: FleetPorts, index: int) -> str:
    return f"http://127.0.0.1:{ports.http + index}"


def sample(base_url: str, name: str, **labels: str) -> float | None:
    """The value of the sample called name (counters end in _total) with labels, from base_url/metrics, summed
    over the labels not given (a counter's requests of every API, say); None when there is none (a labelled
    metric not touched yet)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = [
        float(found.value)
        for family in text_string_to_metric_families(text)
        for found in family.samples
        if found.name == name and all(found.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


def metric(base_url: str, name: str, **labels: str) -> float:
    """The value of the sample called name with labels; fails the test when there is none."""
    value = sample(base_url, name, **labels)
    if value is None:
        raise AssertionError(f"no sample {name} with {labels} at {base_url}")
    return value


def ipv6_loopback() -> bool:
    """Whether this machine can listen on ::1."""
    with socket.socket(socket.AF_INET6) as sock:
        try:
            sock.bind(("::1", 0))
        except OSError:
            return False
    return True


# `make test` runs the tests on two workers, the real engines' on one of them (tests/support/scheduling.py).
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> EnginesTogether:
    return EnginesTogether(config, log)


def pytest_configure(config: pytest.Config) -> None:
    # Each worker, and every process it starts, picks its servers' ports from a range of its own: two
    # workers probing the same free port would both start a server on it.
    worker = getattr(config, "workerinput", None)
    if worker is None or PORT_RANGE_ENV in os.environ:
        return
    ports, index, count = server_ports(), int(worker["workerid"].removeprefix("gw")), worker["workercount"]
    share = len(ports) // count
    first = ports.start + index * share
    os.environ[PORT_RANGE_ENV] = f"{first}-{first + share - 1}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The scheduler sees node ids only, so it goes by path: a test marked as starting real engines elsewhere
    # would run beside the stack.
    strays = [
        item.nodeid
        for item in items
        if any(item.get_closest_marker(marker) for marker in ("stack", "image"))
        and not starts_engines(item.nodeid)
    ]
    if strays:
        raise pytest.UsageError(
            f"marked stack or image, outside tests/support/scheduling.py's paths: {strays}"
        )
    items.sort(key=lambda item: not starts_engines(item.nodeid))  # stable: each part keeps its order
