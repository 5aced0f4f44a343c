"""What a discovered pod is to the router: an instance (its ports and role from the configuration, or from
its own annotations)."""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping
from typing import get_args

from router.config import InstanceConfig, Role
from router.discovery.settings import DiscoveryConfig
from router.discovery.wire import Pod

HTTP_PORT, EVENTS_PORT, REPLAY_PORT = (
    "kvroute.io/http-port",
    "kvroute.io/events-port",
    "kvroute.io/replay-port",
)
DATA_PARALLEL_SIZE, ROLE = "kvroute.io/data-parallel-size", "kvroute.io/role"
_NAME_LENGTH = 63  # of an instance name (router/config.py's pattern)
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_.-]")


class PodError(ValueError):
    """A pod whose annotations or labels cannot make an instance: it is left out, and said why."""


def instance_of(pod: Pod, config: DiscoveryConfig, http_port: int) -> InstanceConfig:
    """pod (serving, so with an IP) as an instance; http_port: the engines' unless the pod says otherwise
    (ports.http, or an InferencePool's target port)."""
    annotations = pod.annotations
    host = _host(pod)
    http = _port(annotations, HTTP_PORT, http_port)
    events = _port(annotations, EVENTS_PORT, config.ports.events)
    replay = _port(annotations, REPLAY_PORT, config.ports.replay)
    try:
        return InstanceConfig(
            name=instance_name(pod.metadata.name),
            url=f"http://{host}:{http}",
            events=None if events is None else f"tcp://{host}:{events}",
            replay=None if replay is None else f"tcp://{host}:{replay}",
            models=config.models,
            data_parallel_size=_number(annotations, DATA_PARALLEL_SIZE, config.data_parallel_size),
            role=_role(pod, config.role_label),
        )
    except ValueError as exc:  # pydantic's, naming what the annotations made invalid
        raise PodError(str(exc)) from None


def instance_name(pod_name: str) -> str:
    """A pod's name as an instance name: pod names run to 253 characters, instance names to 63; a long one
    keeps a hash of the whole, so two long names that start alike stay apart."""
    name = _NOT_IN_NAMES.sub("-", pod_name).lstrip("-_.") or "pod"
    if len(name) <= _NAME_LENGTH:
        return name
    digest = hashlib.sha256(pod_name.encode()).hexdigest()[:8]
    return f"{name[: _NAME_LENGTH - 9]}-{digest}"


def _host(pod: Pod) -> str:
    ip = pod.status.pod_ip if pod.status is not None else None
    try:
        address = ipaddress.ip_address(ip or "")
    except ValueError:
        raise PodError(f"{ip!r} is not an IP address") from None
    return f"[{address}]" if address.version == 6 else str(address)


def _port(annotations: Mapping[str, str], key: str, default: int | None) -> int | None:
    if key not in annotations:
        return default
    port = _number(annotations, key, 0)
    if not 1 <= port <= 65535:
        raise PodError(f"annotation {key}: {port} is not a port")
    return port


def _number(annotations: Mapping[str, str], key: str, default: int) -> int:
    text = annotations.get(key)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise PodError(f"annotation {key}: {text!r} is not a number") from None


def _role(pod: Pod, role_label: str | None) -> Role:
    role = pod.annotations.get(ROLE) or (pod.labels.get(role_label) if role_label else None) or "both"
    if role not in get_args(Role):
        where = ROLE if ROLE in pod.annotations else f"label {role_label}"
        raise PodError(f"{where}: {role!r} is not one of prefill, decode, both")
    return role  # type: ignore[return-value]
