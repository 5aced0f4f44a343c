"""Start the fleet and the router as child processes, wait for them, stop exactly what was started."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import yaml


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the child's own process group, SIGKILL it if it does not exit in time.

        Returns once the whole group is gone: children the leader left behind are killed too.
        """
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout_s)
        stop_group(self.process.pid, timeout_s)

    def wait(self, timeout_s: float) -> int:
        """Its exit code; one still running after timeout_s is stopped, its whole group, and the timeout
        raised."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM process group pgid, SIGKILL what is left of it after timeout_s; return once it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_alive(pgid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + timeout_s
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    if group_alive(pgid):
        raise StartupError(f"process group {pgid} survived SIGKILL")


def spawn(
    name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Child:
    """Run argv in its own process group (so stop() reaches its children and nothing else), logging to
    log_dir/name.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log: IO[bytes] = log_path.open("wb")
    process = subprocess.Popen(
        list(argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    log.close()
    return Child(name, process, log_path)


def start(name: str, args: Sequence[str], log_dir: Path) -> Child:
    """Run a kvroute command (``kvroute ARGS``) with this interpreter."""
    return spawn(name, [sys.executable, "-m", "kvroute.cli", *args], log_dir)


def find_executable(name: str, explicit: str | None = None) -> str | None:
    """explicit (a path, or a name on PATH); else name beside this Python (its venv's), else on PATH."""
    if explicit:
        return explicit if Path(explicit).exists() else shutil.which(explicit)
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    child: Child, urls: Sequence[str], timeout_s: float = 60.0, ok: Callable[[str], bool] = http_ok
) -> None:
    wait_all_healthy([(child, url) for url in urls], timeout_s, ok)


def wait_all_healthy(
    checks: Sequence[tuple[Child, str]], timeout_s: float = 60.0, ok: Callable[[str], bool] = http_ok
) -> None:
    """Wait until ok(url) holds for every URL (by default: it answers 200); fail as soon as its child exits,
    or at the deadline, with its log."""
    deadline = time.monotonic() + timeout_s
    pending = list(checks)
    while pending:
        for child, url in list(pending):
            if child.process.poll() is not None:
                raise StartupError(
                    f"{child.name} exited with {child.process.returncode}:\n{child.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise StartupError(
                    f"{child.name} not healthy after {timeout_s:.0f}s at {url} (log {child.log_path}):\n"
                    f"{child.log_tail()}"
                )
            if ok(url):
                pending.remove((child, url))
        if pending:
            time.sleep(0.1)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on port now (TIME_WAIT leftovers do not count, as servers reuse them)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


# Below Linux's default ephemeral range (32768-60999): a port the kernel hands to an outgoing connection
# cannot then be taken from a server started, killed and restarted on it.
_SERVER_PORTS = range(20000, 32768)
# "FIRST-LAST": where processes sharing a machine (test workers) each take ports apart from the others.
PORT_RANGE_ENV = "KVROUTE_SERVER_PORTS"
# Where this process hands out its next block: ports are handed out in turn from a random start, so a port
# chosen but not yet listened on (or kept free on purpose, as a dead instance's) is not handed out again
# until the range has gone round.
_next_port: int | None = None  # None: not yet chosen


def server_ports() -> range:
    """The ports servers are started on: the environment's range, else the default below the ephemeral one."""
    spec = os.environ.get(PORT_RANGE_ENV)
    if not spec:
        return _SERVER_PORTS
    first, _, last = spec.partition("-")
    return range(int(first), int(last) + 1)


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A base port with count consecutive ports free right now, the next such block in this process's turn."""
    global _next_port
    ports = server_ports()
    base = (
        random.randrange(ports.start, ports.stop)
        if _next_port is None or _next_port not in ports
        else _next_port
    )
    probes = 4 * len(ports)  # a crowded range gives up in well under a second
    while probes > 0 and count <= len(ports):
        if base + count > ports.stop:
            base = ports.start
        # From the block's end: a busy port moves the search past it, most of a block at a time.
        busy = next((port for port in reversed(range(base, base + count)) if not port_free(port, host)), None)
        probes -= count if busy is None else base + count - busy
        if busy is None:
            _next_port = base + count if base + count < ports.stop else ports.start
            return base
        base = busy + 1
    raise StartupError(f"no block of {count} free ports in {ports.start}-{ports.stop - 1}")


@dataclass(frozen=True)
class FleetPorts:
    http: int
    events: int
    replay: int
    count: int

    @classmethod
    def allocate(cls, count: int) -> FleetPorts:
        base = free_port_block(count * 3)
        return cls(base, base + count, base + 2 * count, count)

    def fleet_args(self) -> list[str]:
        return [
            "fleet",
            "--instances",
            str(self.count),
            "--port",
            str(self.http),
            "--event-port",
            str(self.events),
            "--replay-port",
            str(self.replay),
        ]

    def instance_args(self, index: int) -> list[str]:
        """The fleet's instance index alone, in a process of its own (so that it can be stopped alone)."""
        return [
            "fleet",
            "--instances",
            "1",
            "--first-index",
            str(index),
            "--port",
            str(self.http + index),
            "--event-port",
            str(self.events + index),
            "--replay-port",
            str(self.replay + index),
        ]

    def health_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.http + i}/health" for i in range(self.count)]

    def router_config(self, block_size: int = 32, **extra: object) -> dict[str, object]:
        instances = [
            {
                "name": f"fleet-{i}",
                "url": f"http://127.0.0.1:{self.http + i}",
                "events": f"tcp://127.0.0.1:{self.events + i}",
                "replay": f"tcp://127.0.0.1:{self.replay + i}",
            }
            for i in range(self.count)
        ]
        config: dict[str, object] = {
            "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],
            "block_size": block_size,
            "instances": instances,
        }
        config.update(extra)
        return config


@contextlib.contextmanager
def running_fleet(ports: FleetPorts, log_dir: Path, extra_args: Sequence[str] = ()) -> Iterator[Child]:
    child = start("fleet", [*ports.fleet_args(), *extra_args], log_dir)
    try:
        wait_healthy(child, ports.health_urls())
        yield child
    finally:
        child.stop()


@contextlib.contextmanager
def running_peer_router(
    name: str,
    args: Callable[[int, int], list[str]],
    log_dir: Path,
    health_path: str,
    ok: Callable[[str], bool] = http_ok,
) -> Iterator[tuple[str, str]]:
    """Another project's router binary on 127.0.0.1, in its own process group: args(port, metrics_port) is its
    command line. Yields its URL and its metrics URL once ok(URL + health_path) holds."""
    port = free_port_block(2)
    child = spawn(name, args(port, port + 1), log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(child, [url + health_path], timeout_s=150, ok=ok)
        yield url, f"http://127.0.0.1:{port + 1}"
    finally:
        child.stop(timeout_s=15)


@contextlib.contextmanager
def running_router(config: dict[str, object], log_dir: Path, name: str = "router") -> Iterator[str]:
    """Yields the router's base URL."""
    with running_router_process(config, log_dir, name) as (url, _):
        yield url


@contextlib.contextmanager
def running_router_process(
    config: dict[str, object], log_dir: Path, name: str = "router"
) -> Iterator[tuple[str, Child]]:
    """Yields the router's base URL and its process (to read its memory, say)."""
    config_path = log_dir / f"{name}.yaml"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port_block(1)
    child = start(name, ["serve", "--config", str(config_path), "--port", str(port)], log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(child, [url + "/metrics"])
        yield url, child
    finally:
        child.stop()
