"""A Kubernetes API server for tests: kmock's emulator (objects kept in memory, list and watch streams) on
127.0.0.1, in a thread of its own with its own event loop, so a test can stop it, start it again on the same
port with the same objects, and break its watches, while clients talk HTTP to it as to a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import urllib.request
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml
from aiohttp import web

T = TypeVar("T")
_VERSIONS = itertools.count(1)
PODS = "v1/pods"
POOLS = "inference.networking.k8s.io/v1/inferencepools"
POOLS_ALPHA = "inference.networking.x-k8s.io/v1alpha2/inferencepools"
SLICES = "discovery.k8s.io/v1/endpointslices"


class _Emulator(kmock.KubernetesEmulator):
    """Takes watch=True (as the generated clients send it) for the watch=true it is."""

    async def __call__(self, raw_request: web.BaseRequest) -> web.StreamResponse:
        if raw_request.query.get("watch") in ("True", "1"):
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.update_query(watch="true"))
        return await super().__call__(raw_request)


class KubeAPI:
    """```
    with running_kube_api() as api:
        api.write_kubeconfig(path)
        api.create("pods", pod("vllm-0", ...))
    ```"""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-api", daemon=True)
        self._server: kmock.Server | None = None
        self._gone = 0  # watches still to answer 410 Gone
        self.port = 0

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()
            self.emulator = self._run(self._emulator())
        self._server = self._run(self._listen())

    def stop_listening(self) -> None:
        """The server goes away: its port closes and every watch stream breaks; the objects stay."""
        server, self._server = self._server, None
        if server is not None:
            self._run(self._close(server))

    def close(self) -> None:
        self.stop_listening()
        self._run(self.emulator.__aexit__(None, None, None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def expire_watches(self, count: int = 1) -> None:
        """The next count watch requests are answered 410 Gone, as a server whose history no longer reaches
        the asked resourceVersion."""
        self._gone += count

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        cluster = {"name": "kmock", "cluster": {"server": self.url}}
        context = {"name": "kmock", "context": {"cluster": "kmock", "user": "test", "namespace": namespace}}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "kmock",
            "clusters": [cluster],
            "contexts": [context],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def create(self, resource: str, obj: dict[str, Any]) -> None:
        self._call("POST", f"{_collection(resource, obj['metadata']['namespace'])}", obj)

    def patch(self, resource: str, namespace: str, name: str, change: dict[str, Any]) -> None:
        self._call("PATCH", f"{_collection(resource, namespace)}/{name}", change)

    def delete(self, resource: str, namespace: str, name: str) -> None:
        self._call("DELETE", f"{_collection(resource, namespace)}/{name}", None)

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> None:
        data = None if body is None else json.dumps(body).encode()
        kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
        request = urllib.request.Request(self.url + path, data, {"content-type": kind}, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    async def _emulator(self) -> kmock.KubernetesEmulator:
        emulator = _Emulator()
        await emulator.__aenter__()
        emulator.resources[PODS] = kmock.ResourceInfo(kind="Pod", singular="pod", namespaced=True)
        emulator.resources[SLICES] = kmock.ResourceInfo(
            kind="EndpointSlice", singular="endpointslice", namespaced=True
        )
        for pools in (POOLS, POOLS_ALPHA):
            emulator.resources[pools] = kmock.ResourceInfo(
                kind="InferencePool", singular="inferencepool", namespaced=True
            )
        # kr8s asks /version/, which a real API server answers as /version
        emulator["get /version/"] << (lambda: emulator._serve_server_version(None))
        emulator[self._expired] << kmock.KubernetesError(status=410, reason="Expired", message="too old")
        return emulator

    def _expired(self, request: kmock.Request) -> bool:
        if self._gone and request.action == kmock.action.WATCH:
            self._gone -= 1
            return True
        return False

    @staticmethod
    async def _close(server: kmock.Server) -> None:
        # A watch stream would hold the shutdown for its timeout: its connection is cut, as by a crash.
        for connection in server.server.runner.server.connections:  # type: ignore[union-attr]
            connection.force_close()
        await server.__aexit__(None, None, None)

    async def _listen(self) -> kmock.Server:
        server = kmock.Server(self.emulator, port=self.port or None)
        await server.__aenter__()
        self.port = server.port
        return server

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)


def _collection(resource: str, namespace: str) -> str:
    group_version, _, plural = resource.rpartition("/")
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


@contextlib.contextmanager
def running_kube_api() -> Iterator[KubeAPI]:
    api = KubeAPI()
    api.start()
    try:
        yield api
    finally:
        api.close()


def pod(
    name: str,
    labels: dict[str, str],
    ip: str | None = "127.0.0.1",
    ready: bool = True,
    annotations: dict[str, str] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running" if ready else "Pending"}
    if ip is not None:
        status["podIP"] = ip
    status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    metadata = {
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "annotations": annotations or {},
        "resourceVersion": str(next(_VERSIONS)),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": status,
    }


def endpoint(
    pod_name: str,
    ip: str = "127.0.0.1",
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
) -> dict[str, Any]:
    """An endpoint of pod_name, its conditions left out where None (unknown), as the controller may."""
    conditions = {"ready": ready, "serving": serving, "terminating": terminating}
    return {
        "addresses": [ip],
        "conditions": {key: value for key, value in conditions.items() if value is not None},
        "targetRef": {"kind": "Pod", "name": pod_name, "namespace": "default"},
    }


def endpoint_slice(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]],
    ports: dict[str, int],
    labels: dict[str, str] | None = None,
    address_type: str = "IPv4",
    namespace: str = "default",
) -> dict[str, Any]:
    """An EndpointSlice of service, as the EndpointSlice controller writes it; ports by name."""
    metadata = {
        "name": name,
        "namespace": namespace,
        "resourceVersion": str(next(_VERSIONS)),
        "labels": {"kubernetes.io/service-name": service, **(labels or {})},
    }
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": metadata,
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"} for port_name, port in ports.items()],
    }
