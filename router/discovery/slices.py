"""What a ready endpoint of a discovered EndpointSlice is to the router: an instance.

A slice carries no pod annotations, so what they give with source kubernetes comes from elsewhere: the
ports from the slice's ports named `http`, `kv-events` and `kv-replay` (the Service's port names; a lone
unnamed port is http), else from the configuration's `ports`; the role from the slice's `role_label` label
(the EndpointSlice controller copies the Service's labels onto its slices: one Service per role); the data
parallel size from the configuration. Pods are not read (by targetRef): that would take a request per
endpoint and the pods' RBAC, which source kubernetes uses better, with one watch.
"""

from __future__ import annotations

import ipaddress
import re
from typing import get_args

from router.config import InstanceConfig, Role
from router.discovery.pods import instance_name
from router.discovery.settings import DiscoveryConfig
from router.discovery.wire import Endpoint, EndpointSlice

HTTP_PORT, EVENTS_PORT, REPLAY_PORT = "http", "kv-events", "kv-replay"
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class EndpointError(ValueError):
    """An endpoint that cannot make an instance: it is left out, and said why."""


def instance_of_endpoint(
    endpoint: Endpoint, found_in: EndpointSlice, config: DiscoveryConfig
) -> InstanceConfig:
    """endpoint (serving, so with an address) of found_in as an instance, named after its pod."""
    host = _host(endpoint.addresses[0], found_in.address_type)
    named = {port.name or "": port.port for port in found_in.ports or () if port.port is not None}
    lone = named[""] if len(named) == 1 and "" in named else None
    http = named.get(HTTP_PORT) or lone or config.ports.http
    events, replay = named.get(EVENTS_PORT, config.ports.events), named.get(REPLAY_PORT, config.ports.replay)
    try:
        return InstanceConfig(
            name=instance_name(_name(endpoint, found_in)),
            url=f"http://{host}:{http}",
            events=None if events is None else f"tcp://{host}:{events}",
            replay=None if replay is None else f"tcp://{host}:{replay}",
            models=config.models,
            data_parallel_size=config.data_parallel_size,
            role=_role(found_in, config.role_label),
        )
    except ValueError as exc:  # pydantic's
        raise EndpointError(str(exc)) from None


def _name(endpoint: Endpoint, found_in: EndpointSlice) -> str:
    """Its pod's name, as source kubernetes names the instance; else its hostname; else slice and address."""
    ref = endpoint.target_ref
    if ref is not None and ref.kind == "Pod" and ref.name:
        return ref.name
    return endpoint.hostname or f"{found_in.metadata.name}-{endpoint.addresses[0]}"


def _host(address: str, address_type: str) -> str:
    if address_type == "FQDN":
        if not _HOSTNAME.match(address):
            raise EndpointError(f"{address!r} is not a host name")
        return address
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise EndpointError(f"{address!r} is not an IP address") from None
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _role(found_in: EndpointSlice, role_label: str | None) -> Role:
    role = (found_in.labels.get(role_label) if role_label else None) or "both"
    if role not in get_args(Role):
        raise EndpointError(f"label {role_label}: {role!r} is not one of prefill, decode, both")
    return role  # type: ignore[return-value]
