"""Debian's redis-server and nats-server run for a test or a benchmark: on 127.0.0.1, a port of their own, no
persistence, in their own process group and stopped by it (scripts/install_shared_stores.sh installs them)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvroute.processes import Child, StartupError, find_executable, free_port_block, spawn


@dataclass
class StoreServer:
    url: str  # redis://127.0.0.1:PORT/0 or nats://127.0.0.1:PORT
    port: int
    child: Child


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def wait_listening(child: Child, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _listening(port):
        if child.process.poll() is not None:
            raise StartupError(f"{child.name} exited: {child.log_tail()}")
        if time.monotonic() > deadline:
            child.stop()
            raise StartupError(f"{child.name} not listening on {port} within {timeout_s:g} s")
        time.sleep(0.05)


def redis_argv(port: int) -> list[str]:
    executable = find_executable("redis-server")
    if executable is None:
        raise StartupError("redis-server not found: run scripts/install_shared_stores.sh")
    return [executable, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]


def start_redis(log_dir: Path, port: int | None = None, name: str = "redis") -> StoreServer:
    """A redis-server listening; port: the one it had before (a restart), else a free one."""
    port = port or free_port_block(1)
    child = spawn(name, redis_argv(port), log_dir)
    wait_listening(child, port)
    return StoreServer(f"redis://127.0.0.1:{port}/0", port, child)


@contextlib.contextmanager
def running_redis(log_dir: Path) -> Iterator[StoreServer]:
    server = start_redis(log_dir)
    try:
        yield server
    finally:
        server.child.stop()


@contextlib.contextmanager
def running_nats(log_dir: Path) -> Iterator[StoreServer]:
    """nats-server with JetStream (its key-value buckets), its store in log_dir."""
    executable = find_executable("nats-server")
    if executable is None:
        raise StartupError("nats-server not found: run scripts/install_shared_stores.sh")
    port = free_port_block(1)
    store = log_dir / "nats-store"
    argv = [executable, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    child = spawn("nats", argv, log_dir)
    try:
        wait_listening(child, port)
        yield StoreServer(f"nats://127.0.0.1:{port}", port, child)
    finally:
        child.stop()
