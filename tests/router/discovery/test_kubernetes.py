"""Discovery end to end: a Kubernetes API server (kmock, over HTTP, with watch streams), a simulated vLLM
fleet, and a router (`kvroute serve`) that knows its instances only from pods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvroute.processes import FleetPorts
from tests.conftest import sample
from tests.router.discovery.kube_api import PODS, POOLS, KubeAPI, pod
from tests.router.discovery.live import (
    healthy,
    outage_survived,
    removed_mid_stream,
    routed,
    router,
    seconds_until,
)

LABELS = {"app": "vllm"}


def vllm_pod(
    ports: FleetPorts, number: int, labels: dict[str, str] = LABELS, **kwargs: Any
) -> dict[str, Any]:
    """Engine number of the fleet as a pod: all listen on 127.0.0.1, so each says its ports."""
    annotations = {
        "kvroute.io/http-port": str(ports.http + number),
        "kvroute.io/events-port": str(ports.events + number),
        "kvroute.io/replay-port": str(ports.replay + number),
    }
    return pod(f"vllm-{number}", labels, annotations=annotations | kwargs.pop("annotations", {}), **kwargs)


def test_pods_come_and_go_ready_ones_only(fleet: FleetPorts, kube: KubeAPI, tmp_path: Path) -> None:
    kube.create(PODS, vllm_pod(fleet, 0))
    kube.create(PODS, vllm_pod(fleet, 2, ready=False))  # not Ready: never a candidate
    kube.create(PODS, pod("other", {"app": "web"}, annotations={"kvroute.io/http-port": str(fleet.http + 2)}))
    with router(kube, tmp_path, {"selector": "app=vllm"}) as url:
        seconds_until(lambda: healthy(url) == ["vllm-0"])
        assert routed(url) == {"vllm-0"}

        kube.create(PODS, vllm_pod(fleet, 1))
        took = seconds_until(lambda: "vllm-1" in routed(url, 2), timeout_s=5)
        assert took < 5, f"a new Ready pod took {took:.2f} s to take traffic"
        assert routed(url) == {"vllm-0", "vllm-1"}

        # A request in flight on the pod that goes finishes; from 1 s after the event it gets no new one.
        removed_mid_stream(url, "vllm-1", lambda: kube.delete(PODS, "default", "vllm-1"))

        # Terminating (deletionTimestamp set, still Ready): out at once; Ready again after a restart: in.
        kube.patch(PODS, "default", "vllm-0", {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}})
        kube.create(PODS, vllm_pod(fleet, 1))
        seconds_until(lambda: healthy(url) == ["vllm-1"], timeout_s=5)
        assert routed(url) == {"vllm-1"}
        assert sample(url, "kvroute_discovered_instances", source="kubernetes") == 1


def test_a_broken_watch_keeps_the_last_set_and_is_counted(
    fleet: FleetPorts, kube: KubeAPI, tmp_path: Path
) -> None:
    kube.create(PODS, vllm_pod(fleet, 0))
    with router(kube, tmp_path, {"selector": "app=vllm"}) as url:
        seconds_until(lambda: healthy(url) == ["vllm-0"])
        outage_survived(
            url,
            kube,
            "kubernetes",
            lambda: kube.create(PODS, vllm_pod(fleet, 1)),
            lambda: kube.delete(PODS, "default", "vllm-0"),
        )


def test_an_inferencepool_selects_the_pods_and_its_target_port(
    fleet: FleetPorts, kube: KubeAPI, tmp_path: Path
) -> None:
    kube.create(
        PODS, pod("engine-a", {"pool": "a"}, annotations={"kvroute.io/events-port": str(fleet.events)})
    )
    kube.create(PODS, vllm_pod(fleet, 1, labels={"pool": "b"}))
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "tiny", "namespace": "default", "resourceVersion": "1"},
        "spec": {"selector": {"matchLabels": {"pool": "a"}}, "targetPorts": [{"number": fleet.http}]},
    }
    kube.create(POOLS, pool)
    with router(kube, tmp_path, {"source": "inferencepool", "inferencepool": "tiny"}) as url:
        seconds_until(lambda: healthy(url) == ["engine-a"])  # at the pool's target port: it has no annotation
        assert routed(url) == {"engine-a"}
        kube.patch(POOLS, "default", "tiny", {"spec": {"selector": {"matchLabels": {"pool": "b"}}}})
        seconds_until(lambda: routed(url) == {"vllm-1"}, timeout_s=5)
        assert sample(url, "kvroute_discovered_instances", source="inferencepool") == 1
