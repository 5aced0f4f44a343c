"""The Helm chart: every combination of mode, fleet, replicas and ServiceMonitor renders, lints, meets the
Kubernetes (and Prometheus Operator) schemas, and carries a router configuration that `kvroute check-config`
accepts; the pieces are wired to each other (ports, probes, labels, RBAC, the replicas' store)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from router.config import RouterConfig
from tests.deploy.chart import (
    CASES,
    CHART,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    RELEASE,
    STATIC_FLEET,
    Case,
    container,
    helm,
    of_kind,
    one,
    render,
    render_values,
    router_config,
    service_monitor_errors,
    store_of,
)

CASE_IDS = [case.id for case in CASES]
DISCOVERY_KEYS = {
    "source",
    "namespace",
    "kubeconfig",
    "selector",
    "service",
    "inferencepool",
    "ports",
    "models",
    "role_label",
    "data_parallel_size",
}
ROUTER_HAS_DISCOVERY = "discovery" in RouterConfig.model_fields
WATCH = ["get", "list", "watch"]
PODS_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": WATCH}
POOLS_RULE = {
    "apiGroups": ["inference.networking.k8s.io", "inference.networking.x-k8s.io"],
    "resources": ["inferencepools"],
    "verbs": WATCH,
}
SLICES_RULE = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": WATCH}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_lints_strictly(case: Case) -> None:
    done = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, values=case.values())
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_manifests_meet_the_kubernetes_schemas(case: Case, version: str) -> None:
    manifests = render(case)
    expected = {"ServiceAccount", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget"}
    expected |= {"Role", "RoleBinding"} if case.fleet == "discovery" else set()
    expected |= {"ServiceMonitor"} if case.service_monitor else set()
    expected |= {"StatefulSet"} if case.replicas > 1 else set()
    assert {doc["kind"] for doc in manifests} == expected
    for doc in manifests:
        if doc["kind"] != "ServiceMonitor":  # a CRD: test_service_monitor_meets_its_crd
            # strict: a field Kubernetes does not know is an error, as kubectl's server-side validation has it
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("case", [case for case in CASES if case.service_monitor], ids=lambda case: case.id)
def test_service_monitor_meets_its_crd(case: Case) -> None:
    manifests = render(case)
    monitor, service = one(manifests, "ServiceMonitor"), one(manifests, "Service")
    broken = {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "http", "interval": 15}]}}
    valid, invalid = service_monitor_errors([monitor, broken])
    assert valid == []
    assert invalid and "interval must be string" in invalid[0]  # the schema does reject
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] == {"serve": "http", "epp": "metrics"}[case.mode]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}


# The configuration depends on the fleet and the replicas only.
CONFIG_CASES = [case for case in CASES if case.mode == "serve" and not case.service_monitor]


INFERENCEPOOL = {"mode": "epp", "discovery": {"source": "inferencepool", "inferencepool": "llama"}}
ENDPOINTSLICES: dict[str, Any] = {
    "replicaCount": 3,
    "discovery": {"source": "endpointslices", "service": "vllm"},
}
ELSEWHERE = {"replicaCount": 3, "discovery": {"namespace": "vllm"}}


@pytest.mark.parametrize(
    "values",
    [case.values() for case in CONFIG_CASES] + [INFERENCEPOOL, ENDPOINTSLICES, ELSEWHERE],
    ids=[case.id for case in CONFIG_CASES] + ["inferencepool", "endpointslices", "discovery-elsewhere"],
)
def test_config_passes_check_config(values: dict[str, Any], tmp_path: Path) -> None:
    if values.get("discovery", {}).get("enabled", True) and not ROUTER_HAS_DISCOVERY:
        pytest.skip("router/config.py has no discovery section yet")
    path = tmp_path / "config.yaml"
    path.write_text(one(render_values(values), "ConfigMap")["data"]["config.yaml"])
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{path}: ok" in done.stdout


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fleet_and_store_in_the_config(case: Case) -> None:
    manifests = render(case)
    config = router_config(manifests)
    if case.fleet == "static":
        assert config["instances"] == STATIC_FLEET
        assert "discovery" not in config
    else:
        assert config["instances"] == []
        assert set(config["discovery"]) == DISCOVERY_KEYS
        assert config["discovery"]["source"] == "kubernetes"
        assert config["discovery"]["selector"] == "app=vllm"
        assert config["discovery"]["ports"] == {"http": 8000, "events": 5557, "replay": None}
    store = store_of(manifests)
    if case.replicas == 1:
        assert "shared" not in config and store == {}
        return
    # The replicas share this release's Redis: its Service, in front of its one pod, is the config's URL.
    service, pods = store["Service"], store["StatefulSet"]
    assert config["shared"] == {"url": f"redis://{service['metadata']['name']}:6379/0"}
    assert pods["spec"]["replicas"] == 1
    labels = pods["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert pods["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (redis,) = pods["spec"]["template"]["spec"]["containers"]
    assert [port["containerPort"] for port in redis["ports"]] == [6379]
    # and none of the router's selectors picks a store pod
    router = one(manifests, "Deployment")["spec"]["selector"]["matchLabels"]
    assert not router.items() <= labels.items()
    assert not one(manifests, "Service")["spec"]["selector"].items() <= labels.items()


def test_replicas_may_share_a_store_of_their_own() -> None:
    manifests = render_values({"replicaCount": 2, "store": {"url": "rediss://valkey.cache:6380/2"}})
    assert router_config(manifests)["shared"] == {"url": "rediss://valkey.cache:6380/2"}
    assert store_of(manifests) == {}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_mode_sets_command_ports_and_probes(case: Case) -> None:
    manifests = render(case)
    main = container(manifests)
    service_ports = {port["name"]: port["port"] for port in one(manifests, "Service")["spec"]["ports"]}
    assert main["command"] == ["kvroute"]
    if case.mode == "serve":
        assert main["args"] == ["serve", "--config=/etc/kvroute/config.yaml", "--host=0.0.0.0", "--port=8000"]
        assert service_ports == {"http": 8000}
        assert main["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert main["livenessProbe"]["tcpSocket"] == {"port": "http"}  # a fleet down must not restart it
    else:
        assert main["args"] == [
            "epp",
            "--config=/etc/kvroute/config.yaml",
            "--host=0.0.0.0",
            "--port=9002",
            "--metrics-port=9090",
        ]
        assert service_ports == {"grpc": 9002, "metrics": 9090}
        liveness, readiness = {"port": 9002, "service": "liveness"}, {"port": 9002, "service": "readiness"}
        assert main["startupProbe"]["grpc"] == main["livenessProbe"]["grpc"] == liveness
        assert main["readinessProbe"]["grpc"] == readiness  # NOT_SERVING while no instance is healthy
    container_ports = {port["name"]: port["containerPort"] for port in main["ports"]}
    assert {name: container_ports[name] for name in service_ports} == service_ports
    mount = next(m for m in main["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/kvroute" and "subPath" not in mount  # so a changed ConfigMap reloads


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_labels_select_this_release_s_pods(case: Case) -> None:
    manifests = render(case)
    deployment = one(manifests, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] == case.replicas
    for selector in (
        deployment["spec"]["selector"]["matchLabels"],
        one(manifests, "Service")["spec"]["selector"],
        one(manifests, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    ):
        assert selector == {"app.kubernetes.io/name": "kvroute", "app.kubernetes.io/instance": RELEASE}
        assert selector.items() <= pod_labels.items()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rbac_lets_discovery_watch_pods(case: Case) -> None:
    manifests = render(case)
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    account = one(manifests, "ServiceAccount")["metadata"]["name"]
    assert pod["serviceAccountName"] == account
    assert pod["automountServiceAccountToken"] is (case.fleet == "discovery")
    if case.fleet == "static":
        assert of_kind(manifests, "Role") == of_kind(manifests, "RoleBinding") == []
        return
    role, binding = one(manifests, "Role"), one(manifests, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [PODS_RULE]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]


def test_discovery_elsewhere_gets_a_role_there_only() -> None:
    manifests = render_values(ELSEWHERE)
    roles = {doc["metadata"]["namespace"] for doc in of_kind(manifests, "Role")}
    bindings = {doc["metadata"]["namespace"] for doc in of_kind(manifests, "RoleBinding")}
    assert roles == bindings == {"vllm"}
    assert router_config(manifests)["discovery"]["namespace"] == "vllm"


def test_an_inferencepool_fleet_takes_the_pool_s_selector() -> None:
    manifests = render_values(INFERENCEPOOL)
    discovery = router_config(manifests)["discovery"]
    assert (discovery["source"], discovery["inferencepool"]) == ("inferencepool", "llama")
    assert discovery["selector"] is None  # the router takes no selector beside a pool
    assert one(manifests, "Role")["rules"] == [PODS_RULE, POOLS_RULE]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_an_endpointslices_fleet_reads_the_service_s_slices(version: str) -> None:
    manifests = render_values(ENDPOINTSLICES)
    discovery = router_config(manifests)["discovery"]
    assert (discovery["source"], discovery["service"], discovery["selector"]) == (
        "endpointslices",
        "vllm",
        None,
    )
    assert one(manifests, "Role")["rules"] == [SLICES_RULE]
    for doc in manifests:
        kubernetes_validate.validate(doc, version, strict=True)
    elsewhere = render_values({"discovery": {**ENDPOINTSLICES["discovery"], "namespace": "vllm"}})
    assert [(role["metadata"]["namespace"], role["rules"]) for role in of_kind(elsewhere, "Role")] == [
        ("vllm", [SLICES_RULE])
    ]
    by_selector = {"discovery": {"source": "endpointslices", "selector": "app=vllm"}}
    assert router_config(render_values(by_selector))["discovery"]["selector"] == "app=vllm"


def test_the_config_values_pass_through() -> None:
    config: dict[str, Any] = {
        "models": [{"name": "llama", "tokenizer": "remote"}],
        "traffic": {"split": {"kvroute": 90, "round-robin": 10}},
        "shared": {"interval_s": 0.1},
    }
    manifests = render_values({"config": config, "replicaCount": 2})
    rendered = router_config(manifests)
    assert rendered["models"] == config["models"] and rendered["traffic"] == config["traffic"]
    assert rendered["shared"] == {"interval_s": 0.1, "url": "redis://kvr-kvroute-store:6379/0"}  # merged


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"mode": "proxy"}, "value must be one of 'serve', 'epp'"),
        ({"replicas": 3}, "additional properties 'replicas' not allowed"),
        ({"discovery": {"enabled": False}}, "a static fleet needs instances"),
        (
            {"discovery": {"source": "endpoints"}},
            "value must be one of 'kubernetes', 'inferencepool', 'endpointslices'",
        ),
        (
            {"discovery": {"source": "endpointslices", "selector": None}},
            "at '/discovery/service': got null, want string",
        ),
        ({"discovery": {"selectr": "app=vllm"}}, "additional properties 'selectr' not allowed"),
        ({"discovery": {"source": "inferencepool"}}, "at '/discovery/inferencepool': got null, want string"),
        ({"config": {"models": [{"name": "m"}], "instances": STATIC_FLEET}}, "at '/config': 'not' failed"),
        ({"epp": {"port": 70000}}, "at '/epp/port': maximum"),
        ({"store": {"url": "valkey:6379"}}, "at '/store/url'"),
    ],
)
def test_bad_values_are_refused(values: dict[str, Any], error: str) -> None:
    done = helm("template", RELEASE, str(CHART), values=values)
    assert done.returncode != 0
    assert error in done.stderr, done.stderr
