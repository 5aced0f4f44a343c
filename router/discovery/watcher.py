"""The watch: list the pods (or EndpointSlices) a selector picks, then follow their changes, and hand the
Ready ones to the router as instances each time the set changes.

A session lists and watches until the watch breaks; it then raises, and its supervisor starts a new one
with backoff (router/supervisor.py), which lists again: a pod deleted while no watch ran is not missed.
What was found last keeps serving meanwhile. A watch the server ends (its timeout) is resumed from the last
resourceVersion without a new list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import msgspec

from router.config import ConfigError, InstanceConfig, data_parallel_ranks
from router.discovery.kube import Kube, KubeError, error, own_namespace
from router.discovery.pods import PodError, instance_of
from router.discovery.settings import DiscoveryConfig
from router.discovery.slices import EndpointError, instance_of_endpoint
from router.discovery.wire import (
    EndpointSlice,
    EndpointSliceList,
    InferencePool,
    ObjectMeta,
    Pod,
    PodList,
    PoolList,
    Status,
    WatchEvent,
)
from router.label_selector import LabelSelector
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

# The InferencePool's API versions, the newest first: GA, then the x-k8s.io alpha llm-d still ships.
POOL_APIS = ("inference.networking.k8s.io/v1", "inference.networking.x-k8s.io/v1alpha2")
_pod_list, _pool_list = msgspec.json.Decoder(PodList), msgspec.json.Decoder(PoolList)
_event, _pod, _pool = (
    msgspec.json.Decoder(WatchEvent),
    msgspec.json.Decoder(Pod),
    msgspec.json.Decoder(InferencePool),
)
_status = msgspec.json.Decoder(Status)
_slice_list, _slice = msgspec.json.Decoder(EndpointSliceList), msgspec.json.Decoder(EndpointSlice)
SERVICE_NAME = "kubernetes.io/service-name"  # the label an EndpointSlice names its Service by


class _Labelled(Protocol):
    @property
    def metadata(self) -> ObjectMeta: ...

    @property
    def labels(self) -> dict[str, str]: ...


Watched = TypeVar("Watched", bound=_Labelled)


@dataclass(frozen=True)
class Discovered:
    instances: tuple[InstanceConfig, ...] = ()


class FleetSink(Protocol):
    def __call__(self, fleet: Discovered, /) -> None:
        """Take fleet as what discovery finds now; ConfigError when it cannot (the last one stays)."""


class Discovery:
    def __init__(self, config: DiscoveryConfig, sink: FleetSink, metrics: RouterMetrics) -> None:
        self._config, self._sink = config, sink
        self._namespace = config.namespace or own_namespace()
        self._restarts = metrics.discovery_watch_restarts(config.source)
        self._found = metrics.discovered_instances(config.source)
        self._pods: dict[str, Pod] = {}
        self._slices: dict[str, EndpointSlice] = {}
        self._http_port = config.ports.http  # an InferencePool's target port replaces it
        self._published: Discovered | None = None
        self._told: set[tuple[str, str]] = set()  # problems logged, each once

    async def run(self) -> None:
        """One session, until its watch breaks: then it raises, counted."""
        try:
            async with await Kube.connect(self._config.kubeconfig) as kube, asyncio.TaskGroup() as tasks:
                if self._config.source == "endpointslices":
                    tasks.create_task(self._follow_slices(kube))
                elif self._config.selector is not None:
                    tasks.create_task(self._follow(kube, LabelSelector.parse(self._config.selector)))
                else:
                    tasks.create_task(self._follow_pool(kube))
        except Exception as exc:
            failure = exc
            while isinstance(failure, ExceptionGroup):  # the watch that broke, out of its task groups
                failure = failure.exceptions[0]
            self._restarts.inc()
            log.warning(
                "Kubernetes discovery broke (%s); the last %d instances keep serving",
                failure,
                len(self._published.instances) if self._published else 0,
            )
            raise failure from None

    async def _follow(self, kube: Kube, selector: LabelSelector) -> None:
        path = f"/api/v1/namespaces/{self._namespace}/pods"
        await _mirror(kube, path, selector, _PODS, self._pods, self._publish)

    async def _follow_slices(self, kube: Kube) -> None:
        """The EndpointSlices of the Service (or those the selector picks)."""
        config = self._config
        selector = LabelSelector.parse(config.selector or f"{SERVICE_NAME}={config.service}")
        path = f"/apis/discovery.k8s.io/v1/namespaces/{self._namespace}/endpointslices"
        await _mirror(kube, path, selector, _SLICES, self._slices, self._publish)

    async def _follow_pool(self, kube: Kube) -> None:
        """The pods of the InferencePool; when its selector or target port changes, those of the new."""
        path, pool, version = await self._read_pool(kube)
        while True:
            selector, self._http_port = self._target(pool)
            log.info("InferencePool %s selects %s, port %d", pool.metadata.name, selector, self._http_port)
            async with asyncio.TaskGroup() as tasks:
                pods = tasks.create_task(self._follow(kube, selector))
                pool, version = await self._pool_changed(kube, path, pool, version)
                pods.cancel()

    async def _read_pool(self, kube: Kube) -> tuple[str, InferencePool, str | None]:
        name, query = (
            self._config.inferencepool,
            {"fieldSelector": f"metadata.name={self._config.inferencepool}"},
        )
        for api in POOL_APIS:
            path = f"/apis/{api}/namespaces/{self._namespace}/inferencepools"
            try:
                listing = _pool_list.decode(await kube.get(path, query))
            except KubeError as exc:
                if " 404" in str(exc):  # the cluster does not serve this version: try the next
                    continue
                raise
            for pool in listing.items:
                if pool.metadata.name == name:
                    return path, pool, listing.metadata.resource_version if listing.metadata else None
        raise KubeError(f"no InferencePool {name} in namespace {self._namespace} ({', '.join(POOL_APIS)})")

    async def _pool_changed(
        self, kube: Kube, path: str, pool: InferencePool, version: str | None
    ) -> tuple[InferencePool, str | None]:
        """Returns once the pool selects other pods or another port: the new pool and where its watch
        stands. Its deletion is an error: the pods it had keep serving until it is back."""
        query = {"fieldSelector": f"metadata.name={pool.metadata.name}"}
        target = self._target(pool)
        while True:
            async for event in _watched(kube, path, query, version):
                changed = _pool.decode(event.object)
                version = changed.metadata.resource_version or version
                if event.type == "BOOKMARK" or changed.metadata.name != pool.metadata.name:
                    continue
                if event.type == "DELETED":
                    raise KubeError(f"InferencePool {pool.metadata.name} was deleted")
                if self._target(changed) != target:
                    return changed, version

    def _target(self, pool: InferencePool) -> tuple[LabelSelector, int]:
        spec = pool.spec
        labels = spec.selector.get("matchLabels", spec.selector)  # v1 is a LabelSelector, v1alpha2 a map
        try:
            selector = LabelSelector.of_labels({str(k): str(v) for k, v in labels.items()})
        except (AttributeError, ValueError) as exc:
            raise KubeError(f"InferencePool {pool.metadata.name}: spec.selector: {exc}") from None
        if spec.target_ports:
            return selector, spec.target_ports[0].number
        return selector, spec.target_port_number or self._config.ports.http

    def _publish(self) -> None:
        instances = self._endpoint_instances() if self._config.source == "endpointslices" else []
        for pod in self._pods.values():
            if not pod.serving():
                continue
            try:
                instances.append(instance_of(pod, self._config, self._http_port))
            except PodError as exc:
                self._tell(f"pod {pod.metadata.name}", str(exc))
        fleet = Discovered(tuple(sorted(instances, key=lambda i: i.name)))
        if fleet == self._published:
            return
        try:
            self._sink(fleet)
        except ConfigError as exc:
            log.error("discovered instances not taken, the last ones stay: %s", exc)
            return
        self._published = fleet
        self._found.set(sum(len(data_parallel_ranks(instance)) for instance in fleet.instances))

    def _endpoint_instances(self) -> list[InstanceConfig]:
        """The slices' serving endpoints, each pod once: the IPv4 slice's when a dual-stack Service has a
        slice of each family, and one of its copies while the controller moves an endpoint between slices."""
        found: dict[str, InstanceConfig] = {}
        for piece in sorted(self._slices.values(), key=lambda s: (s.address_type != "IPv4", s.metadata.name)):
            for endpoint in piece.endpoints or ():
                if not endpoint.serving():
                    continue
                try:
                    instance = instance_of_endpoint(endpoint, piece, self._config)
                except EndpointError as exc:
                    self._tell(f"an endpoint of EndpointSlice {piece.metadata.name}", str(exc))
                    continue
                found.setdefault(instance.name, instance)
        return list(found.values())

    def _tell(self, what: str, problem: str) -> None:
        if (what, problem) not in self._told:
            self._told.add((what, problem))
            log.warning("%s left out of discovery: %s", what, problem)


def _pods_listed(body: bytes) -> tuple[Sequence[Pod], str | None]:
    listing = _pod_list.decode(body)
    return listing.items, listing.metadata.resource_version if listing.metadata else None


def _slices_listed(body: bytes) -> tuple[Sequence[EndpointSlice], str | None]:
    listing = _slice_list.decode(body)
    return listing.items, listing.metadata.resource_version if listing.metadata else None


@dataclass(frozen=True)
class _Decoders(Generic[Watched]):
    """How a kind's list and its watch's objects are read."""

    listed: Callable[[bytes], tuple[Sequence[Watched], str | None]]
    decode: Callable[[bytes], Watched]


_PODS = _Decoders(_pods_listed, _pod.decode)
_SLICES = _Decoders(_slices_listed, _slice.decode)


async def _mirror(
    kube: Kube,
    path: str,
    selector: LabelSelector,
    decoders: _Decoders[Watched],
    found: dict[str, Watched],
    changed: Callable[[], None],
) -> None:
    """Keep found (by name) as the objects at path that selector picks: list, then watch; changed() after
    each change. Returns only by raising, when the watch breaks."""
    query = {"labelSelector": str(selector)}
    items, version = decoders.listed(await kube.get(path, query))
    # The server filters by the selector too; matching here keeps what it sends in check.
    found.clear()
    found.update((item.metadata.name, item) for item in items if selector.matches(item.labels))
    changed()
    while True:
        async for event in _watched(kube, path, query, version):
            item = decoders.decode(event.object)
            version = item.metadata.resource_version or version
            if event.type == "BOOKMARK":
                continue
            if event.type == "DELETED" or not selector.matches(item.labels):
                found.pop(item.metadata.name, None)
            else:
                found[item.metadata.name] = item
            changed()


async def _watched(
    kube: Kube, path: str, query: dict[str, str], version: str | None
) -> AsyncIterator[WatchEvent]:
    """The watch's events from version on; an ERROR event is raised as the API server's error."""
    async for line in kube.watch(path, query | ({"resourceVersion": version} if version else {})):
        event = _event.decode(line)
        if event.type == "ERROR":
            status = _status.decode(event.object)
            raise error(status.code or 500, status.message, f"watch {path}")
        yield event
