"""The Kubernetes objects discovery reads, as typed structs decoded once from the API server's JSON."""

from __future__ import annotations

from typing import Any

import msgspec


class _Object(msgspec.Struct, rename="camel"):
    pass


class ObjectMeta(_Object):
    name: str
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    resource_version: str | None = None
    deletion_timestamp: str | None = None


class Condition(_Object):
    type: str
    status: str


class PodStatus(_Object):
    pod_ip: str | None = msgspec.field(default=None, name="podIP")  # not camel case: IP
    conditions: list[Condition] | None = None


class Pod(_Object):
    metadata: ObjectMeta
    status: PodStatus | None = None

    @property
    def labels(self) -> dict[str, str]:
        return self.metadata.labels or {}

    @property
    def annotations(self) -> dict[str, str]:
        return self.metadata.annotations or {}

    def serving(self) -> bool:
        """Ready, with an address, and not on its way out: a terminating pod still reports Ready until its
        containers stop, but new requests must go elsewhere from the moment it is told to stop."""
        status = self.status
        if self.metadata.deletion_timestamp is not None or status is None or not status.pod_ip:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())


class ListMeta(_Object):
    resource_version: str | None = None


class PodList(_Object):
    items: list[Pod]
    metadata: ListMeta | None = None


class Status(_Object):
    """What the server sends for an error, as a response or as a watch's ERROR event."""

    code: int | None = None
    reason: str | None = None
    message: str | None = None


class WatchEvent(_Object):
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK, ERROR
    object: msgspec.Raw


class PortNumber(_Object):
    number: int


class PoolSpec(_Object):
    """An InferencePool's spec: v1 has selector.matchLabels and targetPorts; v1alpha2 a plain label map and
    targetPortNumber."""

    selector: dict[str, Any]
    target_ports: list[PortNumber] | None = None
    target_port_number: int | None = None


class InferencePool(_Object):
    metadata: ObjectMeta
    spec: PoolSpec


class PoolList(_Object):
    items: list[InferencePool]
    metadata: ListMeta | None = None


class EndpointConditions(_Object):
    """Unset means unknown, which the API asks consumers to take as ready (serving), not terminating."""

    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class ObjectReference(_Object):
    kind: str | None = None
    name: str | None = None


class Endpoint(_Object):
    addresses: list[str]
    conditions: EndpointConditions = msgspec.field(default_factory=EndpointConditions)
    hostname: str | None = None
    target_ref: ObjectReference | None = None

    def serving(self) -> bool:
        """Ready, and neither terminating nor unready under a Service that publishes not-ready addresses
        (which sets ready regardless; serving still tells)."""
        conditions = self.conditions
        if not self.addresses or conditions.terminating is True:
            return False
        return conditions.ready is not False and conditions.serving is not False


class EndpointPort(_Object):
    port: int | None = None
    name: str | None = None


class EndpointSlice(_Object):
    metadata: ObjectMeta
    address_type: str = "IPv4"  # IPv4, IPv6 or FQDN
    endpoints: list[Endpoint] | None = None
    ports: list[EndpointPort] | None = None

    @property
    def labels(self) -> dict[str, str]:
        return self.metadata.labels or {}


class EndpointSliceList(_Object):
    items: list[EndpointSlice]
    metadata: ListMeta | None = None
