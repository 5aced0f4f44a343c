"""The routers ``kvroute bench overhead`` measures, all started at once in front of one backend, and what each
process costs: CPU time and peak RSS read from /proc by PID."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvroute.bench_live import (
    Fleet,
    SkipTarget,
    Target,
    find_vllm_router,
    kvroute_config,
    parse_targets,
    vllm_router_args,
)
from kvroute.processes import Child, free_port_block, spawn, start, wait_all_healthy
from router.config import parse_config

DIRECT = "direct"
PLAIN_PROXY = "python-proxy"  # kvroute/plain_proxy.py: what kvroute's HTTP stack alone costs
_OWN_KINDS = (DIRECT, PLAIN_PROXY)


def parse_overhead_targets(specs: Sequence[str]) -> list[Target]:
    """``direct`` (the backend itself), ``python-proxy`` or anything ``kvroute bench live`` takes."""
    targets = [Target(spec.strip(), spec.strip()) for spec in specs if spec.strip() in _OWN_KINDS]
    others = [spec for spec in specs if spec.strip() not in _OWN_KINDS]
    return targets + parse_targets(others, default_policy="kvroute")


def backend_fleet(ports: Sequence[int], event_ports: Sequence[int] = ()) -> Fleet:
    """The backend's ports as a fleet of instances; event ports (nothing publishes there) only let
    vllm-router's kv_aware start."""
    instances: list[dict[str, object]] = [
        {"name": f"backend-{i}", "url": f"http://127.0.0.1:{port}"} for i, port in enumerate(ports)
    ]
    for instance, events in zip(instances, event_ports, strict=False):
        instance["events"] = f"tcp://127.0.0.1:{events}"
    raw: dict[str, object] = {
        "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],
        "instances": instances,
    }
    return Fleet(parse_config(raw), raw)


@dataclass
class Running:
    target: Target
    url: str = ""
    child: Child | None = None
    skipped: str = ""

    @property
    def pid(self) -> int | None:
        return None if self.child is None else self.child.process.pid


@contextlib.contextmanager
def running_targets(
    targets: Sequence[Target], fleet: Fleet, log_dir: Path, vllm_router: str | None = None
) -> Iterator[list[Running]]:
    """Starts every router at once (each in its own process group), waits until all answer /health, and
    stops exactly those on exit. A router that cannot run here is returned skipped, with the reason."""
    base = free_port_block(2 * len(targets))
    runs: list[Running] = []
    with contextlib.ExitStack() as stack:
        for offset, target in enumerate(targets):
            run = Running(target)
            runs.append(run)
            port = base + 2 * offset
            try:
                if target.kind == DIRECT:
                    run.url = fleet.config.instances[0].url
                elif target.kind == "url":  # a router already running: no process of ours to measure
                    run.url = target.url
                elif target.kind == "kvroute":
                    run.child = _start_kvroute(target, fleet, port, log_dir)
                elif target.kind == PLAIN_PROXY:
                    run.child = _start_plain_proxy(fleet, port, log_dir)
                else:
                    run.child = _start_vllm_router(target, fleet, port, log_dir, vllm_router)
            except SkipTarget as exc:
                run.skipped = str(exc)
                continue
            if run.child is not None:
                stack.callback(run.child.stop, 15.0)
                run.url = f"http://127.0.0.1:{port}"
        # vllm-router answers /health once every worker does; kvroute once one instance passed its checks.
        wait_all_healthy([(r.child, r.url + "/health") for r in runs if r.child is not None], timeout_s=150)
        yield runs


def _start_kvroute(target: Target, fleet: Fleet, port: int, log_dir: Path) -> Child:
    name = f"kvroute-{target.policy}"
    config_path = log_dir / f"{name}.yaml"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(kvroute_config(fleet, target.policy), sort_keys=False))
    return start(name, ["serve", "--config", str(config_path), "--port", str(port)], log_dir)


def _start_plain_proxy(fleet: Fleet, port: int, log_dir: Path) -> Child:
    urls = [instance.url for instance in fleet.config.instances]
    argv = [sys.executable, "-m", "kvroute.plain_proxy", "--port", str(port), *urls]
    return spawn(PLAIN_PROXY, argv, log_dir)


def _start_vllm_router(target: Target, fleet: Fleet, port: int, log_dir: Path, explicit: str | None) -> Child:
    binary = find_vllm_router(explicit)
    if binary is None:
        raise SkipTarget("vllm-router is not installed (pip install 'kvroute[bench]')")
    args = vllm_router_args(binary, target.policy, fleet, port, port + 1)
    return spawn(f"vllm-router-{target.policy}", args, log_dir)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of every thread of pid so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0
