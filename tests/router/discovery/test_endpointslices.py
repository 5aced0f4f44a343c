"""Discovery from EndpointSlices end to end: kmock's API server, the simulated fleet, and a router that knows
its instances only from the ready endpoints of a Service's slices (a slice per engine here: the engines
share 127.0.0.1, and a slice's ports are all its endpoints')."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvroute.processes import FleetPorts
from tests.conftest import sample
from tests.router.discovery.kube_api import SLICES, KubeAPI, endpoint, endpoint_slice
from tests.router.discovery.live import (
    healthy,
    outage_survived,
    removed_mid_stream,
    routed,
    router,
    seconds_until,
)


def engine_slice(ports: FleetPorts, number: int, service: str = "vllm", **conditions: Any) -> dict[str, Any]:
    """Engine number's slice: its pod vllm-NUMBER, its ports by the names the router reads."""
    named = {
        "http": ports.http + number,
        "kv-events": ports.events + number,
        "kv-replay": ports.replay + number,
    }
    return endpoint_slice(f"{service}-{number}", service, [endpoint(f"vllm-{number}", **conditions)], named)


def set_conditions(kube: KubeAPI, number: int, **conditions: Any) -> None:
    kube.patch(SLICES, "default", f"vllm-{number}", {"endpoints": [endpoint(f"vllm-{number}", **conditions)]})


def test_ready_endpoints_come_and_go(fleet: FleetPorts, kube: KubeAPI, tmp_path: Path) -> None:
    kube.create(SLICES, engine_slice(fleet, 0, ready=None))  # unknown readiness: ready, as the API says
    kube.create(SLICES, engine_slice(fleet, 2, ready=False, serving=False))  # not ready: never a candidate
    kube.create(SLICES, engine_slice(fleet, 1, service="other"))  # another Service's
    with router(kube, tmp_path, {"source": "endpointslices", "service": "vllm"}) as url:
        seconds_until(lambda: healthy(url) == ["vllm-0"])
        assert routed(url) == {"vllm-0"}

        kube.create(SLICES, engine_slice(fleet, 1))
        took = seconds_until(lambda: "vllm-1" in routed(url, 2), timeout_s=5)
        assert took < 5, f"a new ready endpoint took {took:.2f} s to take traffic"
        assert routed(url) == {"vllm-0", "vllm-1"}

        # A request in flight on the endpoint that goes finishes; from 1 s after the event it gets no new one.
        removed_mid_stream(url, "vllm-1", lambda: kube.delete(SLICES, "default", "vllm-1"))

        # Terminating (still serving, as while it drains): out at once; ready again: in.
        set_conditions(kube, 0, ready=False, serving=True, terminating=True)
        set_conditions(kube, 2, ready=True, serving=True)
        seconds_until(lambda: healthy(url) == ["vllm-2"], timeout_s=5)
        assert routed(url) == {"vllm-2"}
        assert sample(url, "kvroute_discovered_instances", source="endpointslices") == 1


def test_a_broken_slice_watch_resumes(fleet: FleetPorts, kube: KubeAPI, tmp_path: Path) -> None:
    kube.create(SLICES, engine_slice(fleet, 0))
    discovery = {"source": "endpointslices", "selector": "kubernetes.io/service-name=vllm"}
    with router(kube, tmp_path, discovery) as url:
        seconds_until(lambda: healthy(url) == ["vllm-0"])
        outage_survived(
            url,
            kube,
            "endpointslices",
            lambda: kube.create(SLICES, engine_slice(fleet, 1)),
            lambda: kube.delete(SLICES, "default", "vllm-0"),
        )
