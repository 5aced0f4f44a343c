"""`kvroute serve --workers N`: N router processes on one host, serving one port.

A WorkerPool, the parent process, binds the port (and so fails at once when it is taken) and starts N
workers, each a whole router (router/http/server.py) listening on the port with SO_REUSEPORT: the kernel
spreads new connections evenly over the workers listening, and a worker that died takes none. (One socket
shared by all was measured worse: a worker that wakes first accepts a whole burst of connections, and with
keep-alive it keeps them.) Each worker has its own KV-event subscriptions and so the full block index, its own
health checks, admission limits and A/B results. The workers count each other's requests in flight as routers
in front of one fleet do (router/upstreams/peer_sync.py): each publishes on an ipc:// endpoint in the pool's
private directory and follows the others', besides the peers the configuration names. A configured
`peers.publish` is bound by the pool, which forwards every worker's snapshots there, so routers on other hosts
hear each worker as a peer of its own.

The pool forwards SIGHUP to every worker (each reloads the file; each also watches it), and on SIGTERM
or SIGINT sends SIGTERM to each, which drains as a lone router does; a worker whose pool dies gets
SIGTERM too. A worker that exits is restarted, after a delay that doubles while it keeps exiting soon after
its start; one that exits MAX_STARTUP_FAILURES times in a row before serving ends the pool (exit 1).
Every answer of a worker carries `x-kvroute-worker: PID`.

/metrics: router/metrics.py combines the workers' metrics through a directory the pool owns. The
/admin routes reach the worker that answers: PUT /admin/traffic and POST /admin/ab/reset change that worker
only, and GET /admin/ab reports its own requests. Change the split in the file instead, which every worker
reloads; POST /admin/reload reloads the answering worker at once and the others as their watch sees the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import msgspec
import zmq
from prometheus_client.multiprocess import mark_process_dead

from router.config import ConfigError, PeersConfig, RouterConfig, load_config

log = logging.getLogger(__name__)

MAX_STARTUP_FAILURES = 5
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.5, 30.0
_SERVED_LONG_S = 60.0  # a worker that ran this long starts again with the first backoff
_POLL_S = 0.1
_KILL_AFTER_S = 10.0  # past the drain: what the workers' own grace and cancellation need, and a margin
_BACKLOG = 2048  # uvicorn's


class _Spec(msgspec.Struct, frozen=True):
    """What a worker is started with (one argument, JSON)."""

    config: str
    host: str
    port: int
    publish: str
    follow: list[str]
    ready_dir: str
    parent: int  # the pool's pid
    log_level: int


@dataclass
class _Slot:
    index: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float = 0.0
    backoff_s: float = _FIRST_BACKOFF_S
    startup_failures: int = 0


def run_workers(config: RouterConfig, path: Path, host: str, port: int, workers: int) -> int:
    """Serve with workers processes until SIGTERM or SIGINT; config is path's, already validated. The exit
    code: 0 after a stop, 1 when the port or a worker cannot start."""
    with tempfile.TemporaryDirectory(prefix="kvroute-serve-") as private:
        root = Path(private)
        try:
            held = _listen(host, port, listen=False)
        except OSError as exc:
            print(f"kvroute serve: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
            return 1
        with contextlib.closing(held), zmq.Context() as context:
            endpoints = [f"ipc://{root}/peers-{i}" for i in range(workers)]
            if config.peers.publish is not None:
                try:
                    _forward(context, endpoints, config.peers.publish)
                except zmq.ZMQError as exc:
                    print(f"peers.publish {config.peers.publish} cannot be bound: {exc}", file=sys.stderr)
                    return 1
            pool = WorkerPool(config, path, host, port, root, endpoints)
            return pool.run()


def _listen(host: str, port: int, listen: bool = True) -> socket.socket:
    """Bound as uvicorn binds its own, with SO_REUSEPORT; listen=False: the pool's, which holds the port
    and takes no connection (only listening sockets do)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _forward(context: zmq.Context[zmq.Socket[bytes]], endpoints: list[str], publish: str) -> None:
    """Republish every worker's load snapshots on publish, for the routers on other hosts."""
    front, back = context.socket(zmq.SUB), context.socket(zmq.PUB)
    for sock in (front, back):
        sock.setsockopt(zmq.LINGER, 0)
    back.bind(publish)
    front.setsockopt(zmq.SUBSCRIBE, b"")
    for endpoint in endpoints:
        front.connect(endpoint)

    def relay() -> None:
        with contextlib.suppress(zmq.ContextTerminated, zmq.ZMQError):
            zmq.proxy(front, back)
        front.close()
        back.close()

    threading.Thread(target=relay, name="peers-forward", daemon=True).start()


class WorkerPool:
    """The parent of `kvroute serve --workers N`: starts the workers, restarts those that exit, passes
    signals on. (Not router/supervisor.py, which runs a process's background loops.)"""

    def __init__(
        self, config: RouterConfig, path: Path, host: str, port: int, root: Path, endpoints: list[str]
    ) -> None:
        self._config, self._path, self._host, self._port = config, path, host, port
        self._endpoints = endpoints
        self._metrics_dir, self._ready_dir = root / "metrics", root / "ready"
        self._metrics_dir.mkdir()
        self._ready_dir.mkdir()
        self._slots = [_Slot(i) for i in range(len(endpoints))]
        self._signals: list[int] = []
        self._announced = False

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._received) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }
        try:
            return self._keep_serving()
        finally:
            self._stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _received(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _keep_serving(self) -> int:
        for slot in self._slots:
            self._start(slot)
        while True:
            while self._signals:
                signum = self._signals.pop(0)
                if signum != signal.SIGHUP:
                    log.info("stopping %d workers on %s", len(self._slots), signal.Signals(signum).name)
                    return 0
                log.info("SIGHUP: every worker reloads the configuration")
                self._signal_all(signal.SIGHUP)
            now = time.monotonic()
            for slot in self._slots:
                if slot.process is None:
                    if now >= slot.restart_at:
                        self._start(slot)
                elif slot.process.poll() is not None and not self._exited(slot, now):
                    return 1
            self._announce()
            time.sleep(_POLL_S)

    def _start(self, slot: _Slot) -> None:
        others = [e for i, e in enumerate(self._endpoints) if i != slot.index]
        spec = _Spec(
            str(self._path),
            self._host,
            self._port,
            self._endpoints[slot.index],
            others,
            str(self._ready_dir),
            os.getpid(),
            logging.getLogger().getEffectiveLevel(),
        )
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self._metrics_dir)}
        argv = [sys.executable, "-m", "router.http.workers", msgspec.json.encode(spec).decode()]
        slot.process = subprocess.Popen(argv, env=env)
        slot.started = time.monotonic()
        log.info("worker %d started: pid %d", slot.index, slot.process.pid)

    def _exited(self, slot: _Slot, now: float) -> bool:
        """Schedule the worker's restart; False when it keeps failing to start: the pool gives up."""
        assert slot.process is not None
        pid, code = slot.process.pid, slot.process.returncode
        slot.process = None
        mark_process_dead(pid, str(self._metrics_dir))  # type: ignore[no-untyped-call]
        ready = self._ready_dir / str(pid)
        served = ready.exists()
        ready.unlink(missing_ok=True)
        slot.startup_failures = 0 if served else slot.startup_failures + 1
        if slot.startup_failures >= MAX_STARTUP_FAILURES:
            log.error(
                "worker %d exited with %s before serving, %d times in a row: stopping",
                slot.index,
                code,
                slot.startup_failures,
            )
            return False
        if now - slot.started > _SERVED_LONG_S:
            slot.backoff_s = _FIRST_BACKOFF_S
        delay, slot.backoff_s = slot.backoff_s, min(slot.backoff_s * 2, _MAX_BACKOFF_S)
        slot.restart_at = now + delay
        log.warning(
            "worker %d (pid %d) exited with %s; restarting it in %.1f s", slot.index, pid, code, delay
        )
        return True

    def _announce(self) -> None:
        if self._announced:
            return
        pids = [slot.process.pid for slot in self._slots if slot.process is not None]
        if len(pids) == len(self._slots) and all((self._ready_dir / str(pid)).exists() for pid in pids):
            self._announced = True
            log.info(
                "%d workers serving on %s:%d, pids %s",
                len(pids),
                self._host,
                self._port,
                " ".join(map(str, pids)),
            )

    def _signal_all(self, signum: int) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.send_signal(signum)

    def _stop(self) -> None:
        """SIGTERM every worker, and wait for them to drain; a further SIGTERM or SIGINT asks them to end at
        once (as SIGINT, which uvicorn takes for a second), and SIGKILL ends those left past the grace."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self._config.shutdown_grace_s + _KILL_AFTER_S
        running = [slot.process for slot in self._slots if slot.process is not None]
        while any(process.poll() is None for process in running) and time.monotonic() < deadline:
            if any(signum != signal.SIGHUP for signum in self._signals):
                self._signals.clear()
                self._signal_all(signal.SIGINT)
            time.sleep(_POLL_S)
        for process in running:
            if process.poll() is None:
                log.warning("worker pid %d still running after the grace period: killed", process.pid)
                process.kill()
                process.wait()


def _worker(spec: _Spec) -> int:
    from router.http.server import Worker, run_server

    _end_with(spec.parent)
    path = Path(spec.config)
    try:
        config = load_config(path)
        config.require_api_keys(spec.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    own = {"publish": spec.publish, "subscribe": [*spec.follow, *config.peers.subscribe]}
    peers = PeersConfig.model_validate(config.peers.model_dump() | own)
    try:
        # Listening starts when uvicorn serves, after the app's startup: a connection must not wait in the
        # backlog of a worker still starting (or be reset with it).
        listener = _listen(spec.host, spec.port, listen=False)
    except OSError as exc:
        print(f"kvroute serve: cannot listen on {spec.host}:{spec.port}: {exc}", file=sys.stderr)
        return 1
    ready = Path(spec.ready_dir) / str(os.getpid())
    run_server(config, spec.host, spec.port, path, Worker(listener, peers, ready))
    return 0


def _end_with(parent: int) -> None:
    """SIGTERM this worker when its pool dies, killed even (Linux's PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    worker_spec = msgspec.json.decode(sys.argv[1], type=_Spec)
    logging.basicConfig(
        level=worker_spec.log_level,
        format="%(asctime)s %(levelname)s %(name)s [worker %(process)d]: %(message)s",
    )
    sys.exit(_worker(worker_spec))
