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

from kvroute.bench.overhead.backend import find_nginx, nginx_conf_around
from kvroute.processes import (
    Child,
    StartupError,
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


def balancer_conf(work: Path, port: int, replicas: list[int]) -> str:
    """Round robin over the replicas, keep-alive upstream connections, answers (streams too) unbuffered, a
    long prompt kept in memory rather than in a temp file."""
    servers = "\n".join(f"    server 127.0.0.1:{replica};" for replica in replicas)
    return nginx_conf_around(
        work,
        f"""  client_body_buffer_size 64m;
  upstream replicas {{
{servers}
    keepalive 64;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 300s;
    }}
  }}""",
    )


@contextlib.contextmanager
def running_replicas(config: dict[str, Any], policy: str, log_dir: Path) -> Iterator[tuple[str, str]]:
    """The balancer's URL and the first replica's (its metrics), replicas and balancer started for one
    target and stopped by their process groups after it."""
    count, shared = parse_replicas(policy)
    nginx = find_nginx()
    if nginx is None:
        raise StartupError("nginx is not installed (scripts/install_bench_tools.sh)")
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
        work = log_dir / "balancer"
        conf = work / "nginx.conf"
        conf.write_text(balancer_conf(work, base, ports))
        argv = [nginx, "-p", str(work), "-e", str(work / "nginx-error.log"), "-c", str(conf)]
        balancer = spawn("balancer", argv, log_dir)
        stack.callback(balancer.stop)
        url = f"http://127.0.0.1:{base}"
        wait_healthy(balancer, [url + "/metrics"], timeout_s=20)
        yield url, f"http://127.0.0.1:{ports[0]}"
