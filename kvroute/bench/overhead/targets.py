"""The routers ``kvroute bench overhead`` measures, all started at once in front of one backend, and what each
process costs: CPU time and peak RSS read from /proc by PID."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvroute.bench.live.run import (
    Fleet,
    SkipTarget,
    Target,
    find_vllm_router,
    kvroute_config,
    parse_targets,
    vllm_router_args,
)
from kvroute.bench.overhead.envoy import start_envoy, start_picker
from kvroute.processes import Child, free_port_block, spawn, start, wait_all_healthy
from kvroute.store_servers import running_redis
from router.config import parse_config

DIRECT = "direct"
PLAIN_PROXY = "python-proxy"  # kvroute/bench/overhead/plain_proxy.py: what kvroute's HTTP stack alone costs
ENVOY_EPP = "envoy-epp"  # Envoy (configs/envoy-epp.yaml) asking `kvroute epp`
ENVOY_ONE_FILTER = "envoy-epp-1"  # the same, the picker called from one filter (a GIE gateway's layout)
SERVE_WORKERS = "kvroute-workers"  # `kvroute serve --workers N`
SHARED = "kvroute-shared"  # kvroute with a shared store (a redis-server of its own) and per-flow limits set
_OWN_KINDS = (DIRECT, PLAIN_PROXY, SHARED)
# Limits no request reaches: their bookkeeping, shared through the store, is what the target measures.
_UNREACHED_LIMITS = {"per_flow": {"max_in_flight": 1_000_000, "tokens_per_s": 1e12}}


def parse_overhead_targets(specs: Sequence[str]) -> list[Target]:
    """``direct`` (the backend itself), ``python-proxy``, ``envoy-epp[:POLICY]`` (``envoy-epp:floor``: a
    picker that decides nothing, kvroute/bench/overhead/null_picker.py), ``envoy-epp-1[:POLICY]`` (the picker
    called from one filter), ``kvroute-workers:N`` (kvroute's default policy), ``kvroute-shared`` (kvroute
    sharing a Redis, its flows' limits on) or anything ``kvroute bench live`` takes."""
    targets, others = [], []
    for spec in (s.strip() for s in specs):
        kind, _, arg = spec.partition(":")
        if spec in _OWN_KINDS:
            targets.append(Target(spec, spec))
        elif kind in (ENVOY_EPP, ENVOY_ONE_FILTER):
            targets.append(Target(f"{kind}:{arg or 'kvroute'}", kind, arg or "kvroute"))
        elif kind == SERVE_WORKERS:
            if not arg.isdigit() or int(arg) < 1:
                raise ValueError(f"target {spec!r}: use {SERVE_WORKERS}:N, N the number of worker processes")
            targets.append(Target(spec, SERVE_WORKERS, "kvroute"))
        else:
            others.append(spec)
    return targets + parse_targets(others, default_policy="kvroute")


def serve_workers(target: Target) -> int:
    return int(target.label.partition(":")[2]) if target.kind == SERVE_WORKERS else 1


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
    helpers: list[Child] = field(default_factory=list)  # processes it needs besides its own (Envoy's picker)

    @property
    def pid(self) -> int | None:
        return None if self.child is None else self.child.process.pid

    def cpu_seconds(self) -> float | None:
        """Every process the target started, its children included (`serve --workers`), so far."""
        times = self.user_system_seconds()
        return None if times is None else sum(times)

    def user_system_seconds(self) -> tuple[float, float] | None:
        """cpu_seconds, its user and its system (kernel: the sockets' reads and writes above all) parts."""
        if self.child is None:
            return None
        user = system = 0.0
        for child in (self.child, *self.helpers):
            more_user, more_system = group_user_system_seconds(child.process.pid)
            user, system = user + more_user, system + more_system
        return user, system

    def helpers_cpu_seconds(self) -> float | None:
        """Of cpu_seconds, its helpers' (Envoy's picker); None when it has none."""
        if self.child is None or not self.helpers:
            return None
        return sum(group_cpu_seconds(c.process.pid) for c in self.helpers)

    def peak_rss_mib(self) -> float | None:
        """The largest VmHWM of its processes (one worker of several, the picker or Envoy)."""
        if self.child is None:
            return None
        return max(group_peak_rss_mib(c.process.pid) for c in (self.child, *self.helpers))


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
                elif target.kind == SHARED:
                    store = stack.enter_context(running_redis(log_dir))
                    shared = {"shared": {"url": store.url}, "flow_control": _UNREACHED_LIMITS}
                    run.child = _start_kvroute(target, fleet, port, log_dir, extra=shared)
                elif target.kind == SERVE_WORKERS:
                    run.child = _start_kvroute(target, fleet, port, log_dir, serve_workers(target))
                elif target.kind in (ENVOY_EPP, ENVOY_ONE_FILTER):
                    picker = start_picker(target, fleet, log_dir)
                    stack.callback(picker.child.stop, 15.0)
                    run.helpers.append(picker.child)
                    one_filter = target.kind == ENVOY_ONE_FILTER
                    run.child = start_envoy(fleet, picker.port, port, log_dir, one_filter)
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


def rotated(active: Sequence[Running], index: int) -> list[Running]:
    """The targets in the order cell ``index`` runs them: the first one moves on each cell, so that no
    target always runs first (or right after another)."""
    if not active:
        return []
    rotation = index % len(active)
    return [*active[rotation:], *active[:rotation]]


def _start_kvroute(
    target: Target,
    fleet: Fleet,
    port: int,
    log_dir: Path,
    workers: int = 1,
    extra: dict[str, Any] | None = None,
) -> Child:
    """extra: sections set over the fleet's configuration."""
    policy = target.policy or "kvroute"
    name = target.label.replace(":", "-") if extra else f"kvroute-{policy}"
    name += f"-workers-{workers}" if workers > 1 else ""
    args = ["serve", "--config", str(write_config(fleet, policy, log_dir / f"{name}.yaml", extra))]
    if workers > 1:
        if "--workers" not in serve_help():
            raise SkipTarget("`kvroute serve` has no --workers option in this build")
        args += ["--workers", str(workers)]
    return start(name, [*args, "--port", str(port)], log_dir)


def write_config(fleet: Fleet, policy: str, path: Path, extra: dict[str, Any] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    config = kvroute_config(fleet, policy) | (extra or {})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def serve_help() -> str:
    argv = [sys.executable, "-m", "kvroute.cli", "serve", "--help"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False).stdout


def _start_plain_proxy(fleet: Fleet, port: int, log_dir: Path) -> Child:
    urls = [instance.url for instance in fleet.config.instances]
    argv = [sys.executable, "-m", "kvroute.bench.overhead.plain_proxy", "--port", str(port), *urls]
    return spawn(PLAIN_PROXY, argv, log_dir)


def _start_vllm_router(target: Target, fleet: Fleet, port: int, log_dir: Path, explicit: str | None) -> Child:
    binary = find_vllm_router(explicit)
    if binary is None:
        raise SkipTarget("vllm-router is not installed (pip install 'kvroute[bench]')")
    args = vllm_router_args(binary, target.policy, fleet, port, port + 1)
    return spawn(f"vllm-router-{target.policy}", args, log_dir)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of every thread of pid so far."""
    return sum(user_system_seconds(pid))


def user_system_seconds(pid: int) -> tuple[float, float]:
    """The user and the system CPU time of every thread of pid so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def resident_bytes(pid: int) -> int:
    """pid's resident memory now (its statm)."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group pgid (/proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rpartition(")")[2].split()[2]) == pgid:
                pids.append(int(stat.parent.name))
    return pids


def group_cpu_seconds(pgid: int) -> float:
    """cpu_seconds of every live process in group pgid (each target's processes have a group of their own)."""
    return sum(group_user_system_seconds(pgid))


def group_user_system_seconds(pgid: int) -> tuple[float, float]:
    """user_system_seconds of every live process in group pgid, summed."""
    user = system = 0.0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            more_user, more_system = user_system_seconds(pid)
            user, system = user + more_user, system + more_system
    return user, system


def group_peak_rss_mib(pgid: int) -> float:
    peaks = [0.0]
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            peaks.append(peak_rss_mib(pid))
    return max(peaks)
