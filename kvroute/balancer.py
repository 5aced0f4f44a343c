"""A round-robin balancer in front of several kvroute replicas: Debian's nginx, as an operator would put one
(docs/operations.md, "Several routers in front of one fleet"). `kvroute bench live`'s replica targets and
`kvroute stack up` with `router.replicas` run it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvroute.bench.overhead.backend import find_nginx, nginx_conf_around
from kvroute.processes import StartupError


def balancer_conf(work: Path, host: str, port: int, replicas: Sequence[int]) -> str:
    """Round robin over the replicas (on host), keep-alive upstream connections, answers (streams too)
    unbuffered, a long prompt kept in memory rather than in a temp file."""
    servers = "\n".join(f"    server {host}:{replica};" for replica in replicas)
    return nginx_conf_around(
        work,
        f"""  client_body_buffer_size 64m;
  upstream replicas {{
{servers}
    keepalive 64;
  }}
  server {{
    listen {host}:{port};
    location / {{
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 300s;
    }}
  }}""",
    )


def balancer_argv(work: Path, host: str, port: int, replicas: Sequence[int]) -> list[str]:
    """nginx's command line, its configuration written into work."""
    nginx = find_nginx()
    if nginx is None:
        raise StartupError("nginx is not installed (scripts/install_bench_tools.sh)")
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "nginx.conf"
    conf.write_text(balancer_conf(work, host, port, replicas))
    return [nginx, "-p", str(work), "-e", str(work / "nginx-error.log"), "-c", str(conf)]
