"""`kvroute bench live` targets of several kvroute replicas behind one round-robin balancer (Debian's nginx),
as behind a Service: ``kvroute-replicas:N`` shares nothing between them but what each hears from the engines,
``kvroute-replicas:N+shared`` shares their state through a redis-server (router/shared/)."""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kvroute.balancer import balancer_argv
from kvroute.processes import (
    Child,
    free_port_block,
    spawn,
    start,
    wait_all_healthy,
    wait_healthy,
)
from kvroute.store_servers import running_redis


def parse_replicas(policy: str) -> tuple[int, bool]:
    """``N`` or ``N+shared``: the replicas, and whether they share a store."""
    count, _, variant = policy.partition("+")
    if not count.isdigit() or int(count) < 1 or variant not in ("", "shared"):
        raise ValueError(f"kvroute-replicas:{policy}: use kvroute-replicas:N or kvroute-replicas:N+shared")
    return int(count), variant == "shared"


@contextlib.contextmanager
def running_replicas(config: dict[str, Any], policy: str, log_dir: Path) -> Iterator[tuple[str, str]]:
    """The balancer's URL and the first replica's (its metrics), replicas and balancer started for one
    target and stopped by their process groups after it."""
    count, shared = parse_replicas(policy)
    with contextlib.ExitStack() as stack:
        config = copy.deepcopy(config)
        if shared:
            server = stack.enter_context(running_redis(log_dir))
            config["shared"] = {"url": server.url, "namespace": f"bench-{uuid.uuid4().hex[:8]}"}
        path = log_dir / f"replicas-{policy}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        base = free_port_block(count + 1)
        ports = [base + 1 + n for n in range(count)]
        children: list[Child] = []
        for n, port in enumerate(ports):
            child = start(f"replica-{n}", ["serve", "--config", str(path), "--port", str(port)], log_dir)
            stack.callback(child.stop)
            children.append(child)
        wait_all_healthy(
            [(child, f"http://127.0.0.1:{port}/metrics") for child, port in zip(children, ports, strict=True)]
        )
        argv = balancer_argv(log_dir / "balancer", "127.0.0.1", base, ports)
        balancer = spawn("balancer", argv, log_dir)
        stack.callback(balancer.stop)
        url = f"http://127.0.0.1:{base}"
        wait_healthy(balancer, [url + "/metrics"], timeout_s=20)
        yield url, f"http://127.0.0.1:{ports[0]}"
