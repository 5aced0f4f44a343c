"""SGLang's model gateway (``smg`` 1.13) as ``kvroute bench live``'s ``smg:POLICY`` targets.

``smg launch`` runs in front of the fleet's instances over HTTP (``--worker-urls``) with ``--policy POLICY``
and its other settings at their defaults; cache_aware's are SGLang's (``--cache-threshold`` 0.3,
``--balance-abs-threshold`` 64, ``--balance-rel-threshold`` 1.5, its tree evicted every 60 s). Over HTTP it
loads no tokenizer and reads no KV events: cache_aware matches each request's text, in characters, in a
prefix tree of its own. It answers ``/health`` before it has registered a worker and leaves out one it
cannot reach, so it is ready once ``/readiness`` counts every instance healthy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from kvroute.processes import find_executable, running_peer_router
from router.config import RouterConfig


def find_smg(explicit: str | None) -> str | None:
    return find_executable("smg", explicit)


def smg_args(binary: str, policy: str, config: RouterConfig, port: int, metrics_port: int) -> list[str]:
    return [
        binary,
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--worker-urls",
        *(i.url for i in config.instances),
        "--policy",
        policy,
        "--worker-startup-timeout-secs",
        "120",
        "--worker-startup-check-interval",
        "1",
        "--shutdown-grace-period-secs",  # it drains this long on SIGTERM, even with nothing in flight
        "1",
    ]


def every_worker_healthy(count: int) -> Callable[[str], bool]:
    """A check of smg's ``/readiness`` URL: it counts ``count`` healthy workers."""

    def ready(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                body = json.load(response)
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return isinstance(body, dict) and body.get("healthy_workers") == count

    return ready


@contextlib.contextmanager
def running_smg(binary: str, policy: str, config: RouterConfig, log_dir: Path) -> Iterator[tuple[str, str]]:
    """smg in front of the fleet, in its own process group; yields its URL and its metrics URL."""
    args = functools.partial(smg_args, binary, policy, config)
    ready = every_worker_healthy(len(config.instances))
    with running_peer_router(f"smg-{policy}", args, log_dir, "/readiness", ready) as urls:
        yield urls
