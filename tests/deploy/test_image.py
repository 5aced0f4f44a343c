"""The container image (`make image`: podman, runc, a debootstrap base) runs as the chart runs it: read-only
root, user 10001, no capabilities, its configuration a mounted directory. It checks configurations, and
`kvroute serve` in it answers /health and chats through a simulated fleet on the host (host network), and
`kvroute epp` answers the gRPC health checks the chart's probes make. The simulated fleet is not in it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.processes import FleetPorts, free_port_block, spawn, wait_healthy
from router.config import RouterConfig
from tests.conftest import sample
from tests.deploy.chart import CASES, one, render

pytestmark = pytest.mark.image

IMAGE = os.environ.get("KVROUTE_IMAGE", "localhost/kvroute:dev")
# What the chart's securityContext asks for (deploy/helm/kvroute/values.yaml), and the host's network.
RUN = [
    "podman",
    "run",
    "--runtime",
    "runc",
    "--rm",
    "--network",
    "host",
    "--read-only",
    "--tmpfs",
    "/tmp",
    "--user",
    "10001:10001",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
]


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run `make image`")
    if subprocess.run(["podman", "image", "exists", IMAGE], timeout=60).returncode != 0:
        pytest.fail(f"no image {IMAGE}: run `make image`")
    return IMAGE


def config_dir(tmp_path: Path, config: dict[str, Any] | str) -> Path:
    """A directory holding config.yaml, readable by the image's user (as a ConfigMap volume is)."""
    directory = tmp_path / "etc-kvroute"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)  # whatever the umask
    text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
    (directory / "config.yaml").write_text(text)
    (directory / "config.yaml").chmod(0o644)
    return directory


def run_in_image(image: str, directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [*RUN, "--volume", f"{directory}:/etc/kvroute:ro", image, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("fleet", ["static", "discovery"])
def test_check_config_accepts_the_chart_s_config(image: str, fleet: str, tmp_path: Path) -> None:
    if fleet == "discovery" and "discovery" not in RouterConfig.model_fields:
        pytest.skip("router/config.py has no discovery section yet")
    case = next(case for case in CASES if case.fleet == fleet and case.replicas > 1)
    directory = config_dir(tmp_path, one(render(case), "ConfigMap")["data"]["config.yaml"])
    done = run_in_image(image, directory, "check-config", "/etc/kvroute/config.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "/etc/kvroute/config.yaml: ok" in done.stdout


def test_the_simulated_fleet_is_not_in_the_image(image: str, tmp_path: Path) -> None:
    """The image holds what serve and epp need; kvroute[fleet] is the dev-tools target's (Dockerfile)."""
    done = run_in_image(image, config_dir(tmp_path, {}), "fleet")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "install kvroute[fleet]" in done.stderr


def test_check_config_names_a_bad_key(image: str, tmp_path: Path) -> None:
    directory = config_dir(
        tmp_path, {"models": [{"name": "m"}], "instances": [{"name": "a", "url": "ftp://x"}]}
    )
    done = run_in_image(image, directory, "check-config", "/etc/kvroute/config.yaml")
    assert done.returncode == 2
    assert "instances.0.url" in done.stdout + done.stderr


@contextlib.contextmanager
def running_container(
    image: str, directory: Path, args: list[str], ready_url: str, log_dir: Path
) -> Iterator[None]:
    """The image running args, its configuration directory mounted, until ready_url answers 200. Stops exactly
    its own container."""
    name = f"kvroute-test-{uuid.uuid4().hex[:12]}"
    child = spawn(
        "container", [*RUN, "--name", name, "--volume", f"{directory}:/etc/kvroute:ro", image, *args], log_dir
    )
    try:
        wait_healthy(child, [ready_url], timeout_s=120)
        yield
    finally:
        subprocess.run(["podman", "stop", "--time", "10", name], capture_output=True, timeout=60)
        subprocess.run(["podman", "rm", "--force", "--ignore", name], capture_output=True, timeout=60)
        child.stop()


@pytest.fixture
def served(image: str, fleet: FleetPorts, tmp_path: Path) -> Iterator[str]:
    """kvroute serve in the image in front of the fleet; yields its URL."""
    port = free_port_block(1)
    args = ["serve", "--config", "/etc/kvroute/config.yaml", "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running_container(
        image, config_dir(tmp_path, fleet.router_config()), args, url + "/health", tmp_path
    ):
        yield url


def test_serve_answers_health_and_a_chat_through_the_fleet(served: str) -> None:
    with urllib.request.urlopen(served + "/health", timeout=10) as response:
        health = json.load(response)
    assert health["status"] == "ok"
    assert sorted(health["healthy_instances"]) == ["fleet-0", "fleet-1", "fleet-2"]

    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Where do the KV events of this answer go? " * 8}],
        "max_tokens": 8,
    }
    request = urllib.request.Request(
        served + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": "image-test"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.load(response)
        instance = response.headers["x-kvroute-instance"]
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0
    assert instance in {"fleet-0", "fleet-1", "fleet-2"}

    # The instance's KV events (ZMQ, from the host) reach the router in the container.
    deadline = time.monotonic() + 10
    while not sample(served, "kvroute_kv_events_total", vllm_instance=instance, type="BlockStored"):
        assert time.monotonic() < deadline, f"no BlockStored event from {instance} reached the router"
        time.sleep(0.1)


def test_epp_answers_the_chart_s_grpc_probes(image: str, fleet: FleetPorts, tmp_path: Path) -> None:
    grpc_port = free_port_block(2)
    args = [
        "epp",
        "--config",
        "/etc/kvroute/config.yaml",
        "--host",
        "127.0.0.1",
        "--port",
        str(grpc_port),
        "--metrics-port",
        str(grpc_port + 1),
    ]
    directory = config_dir(tmp_path, fleet.router_config())
    ready_url = f"http://127.0.0.1:{grpc_port + 1}/health"
    with (
        running_container(image, directory, args, ready_url, tmp_path),
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        checks = health_pb2_grpc.HealthStub(channel)
        # the services the chart's startup, liveness and readiness probes name (deploy/helm/kvroute)
        for service in ("liveness", "readiness"):
            answer = checks.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        assert (
            sample(f"http://127.0.0.1:{grpc_port + 1}", "kvroute_instance_healthy", vllm_instance="fleet-0")
            == 1
        )
