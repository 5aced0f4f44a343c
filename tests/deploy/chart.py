"""The Helm chart (deploy/helm/kvroute) rendered by the real helm, and the schemas its manifests meet.

helm and the ServiceMonitor schema are installed into the venv's chart-tools/ by `make chart-tools`
(scripts/install_chart_tools.sh); Kubernetes' JSON schemas come with kubernetes-validate (the deploy extra).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kvroute"
TOOLS = Path(sys.prefix) / "chart-tools"
HELM = TOOLS / "helm"
RELEASE = "kvr"
NAMESPACE = "llm"
# The Kubernetes releases the chart's manifests are checked against: the oldest it supports (Chart.yaml's
# kubeVersion: gRPC probes are GA from 1.27) and the newest kubernetes-validate has schemas for.
KUBERNETES_VERSIONS = ("1.27.0", "1.37.0")

STATIC_FLEET = [
    {
        "name": f"vllm-{i}",
        "url": f"http://vllm-{i}.vllm.llm.svc:8000",
        "events": f"tcp://vllm-{i}.vllm.llm.svc:5557",
    }
    for i in range(2)
]
Manifest = dict[str, Any]


@dataclass(frozen=True)
class Case:
    mode: str  # serve or epp
    fleet: str  # static or discovery
    replicas: int
    service_monitor: bool

    @property
    def id(self) -> str:
        monitor = "monitor" if self.service_monitor else "no-monitor"
        return f"{self.mode}-{self.fleet}-x{self.replicas}-{monitor}"

    def values(self) -> dict[str, Any]:
        values: dict[str, Any] = {
            "mode": self.mode,
            "replicaCount": self.replicas,
            "serviceMonitor": {"enabled": self.service_monitor},
        }
        if self.fleet == "static":
            values |= {"discovery": {"enabled": False}, "instances": STATIC_FLEET}
        return values


CASES = [
    Case(*combination)
    for combination in itertools.product(("serve", "epp"), ("static", "discovery"), (1, 3), (False, True))
]


def helm(*args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    """helm ARGS on the chart, with values (YAML on standard input) when given."""
    if not HELM.exists():
        raise AssertionError(f"{HELM} is missing: run `make chart-tools`")
    extra = ["--values", "-"] if values is not None else []
    return subprocess.run(
        [str(HELM), *args, *extra],
        input=yaml.safe_dump(values or {}),
        capture_output=True,
        text=True,
        timeout=60,
    )


def render_values(values: dict[str, Any]) -> list[Manifest]:
    """The chart's manifests for values; a failed render fails with helm's message."""
    done = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, values=values)
    if done.returncode != 0:
        raise AssertionError(f"helm template failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@cache
def _rendered(case: Case) -> str:
    return json.dumps(render_values(case.values()))


def render(case: Case) -> list[Manifest]:
    """The case's manifests (rendered once per session; each call gets its own copy)."""
    manifests: list[Manifest] = json.loads(_rendered(case))
    return manifests


STORE_NAME = "kvroute-store"  # the app.kubernetes.io/name of the replicas' store


def is_store(doc: Manifest) -> bool:
    return bool(doc["metadata"].get("labels", {}).get("app.kubernetes.io/name") == STORE_NAME)


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    """The router's manifests of a kind (the store's: store_of)."""
    return [doc for doc in manifests if doc["kind"] == kind and not is_store(doc)]


def store_of(manifests: list[Manifest]) -> dict[str, Manifest]:
    """The replicas' store, by kind."""
    return {doc["kind"]: doc for doc in manifests if is_store(doc)}


def one(manifests: list[Manifest], kind: str) -> Manifest:
    found = of_kind(manifests, kind)
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def router_config(manifests: list[Manifest]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(one(manifests, "ConfigMap")["data"]["config.yaml"])
    return config


def container(manifests: list[Manifest]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def service_monitor_errors(monitors: list[Manifest]) -> list[list[str]]:
    """Each ServiceMonitor's errors against the Prometheus Operator's CRD schema (an empty list: valid)."""
    node_modules = TOOLS / "node_modules"
    if not node_modules.exists():
        raise AssertionError(f"{node_modules} is missing: run `make chart-tools`")
    script = (Path(__file__).parent / "servicemonitor_schema.mjs").read_text()
    done = subprocess.run(
        ["node", "--input-type=module", "--eval", script],
        input=json.dumps(monitors),
        capture_output=True,
        text=True,
        cwd=TOOLS,
        timeout=60,
        check=True,
    )
    errors: list[list[str]] = json.loads(done.stdout)
    return errors
