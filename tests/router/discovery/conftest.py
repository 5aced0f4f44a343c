"""A simulated fleet per test module (3 engines, slow enough decoding to hold a request in flight) and a
Kubernetes API server per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import FleetPorts, running_fleet
from tests.router.discovery.kube_api import KubeAPI, running_kube_api


@pytest.fixture(scope="module")
def ports() -> FleetPorts:
    return FleetPorts.allocate(3)


@pytest.fixture(scope="module")
def fleet(
    ports: FleetPorts, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetPorts]:
    # 200 tokens a second: a 600-token answer is a request in flight for 3 s.
    args = ["--prefill-tps", "200000", "--decode-tps", "200"]
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), args):
        yield ports


@pytest.fixture
def kube() -> Iterator[KubeAPI]:
    with running_kube_api() as api:
        yield api
