"""`kvroute serve --workers N`: N router processes on one host, serving one port.

A WorkerPool, the parent process, makes one socket per worker on the port (and so fails at once when it is
taken), all listening with SO_REUSEPORT, and starts N workers, each a whole router (router/http/server.py)
accepting on its own socket. (One socket shared by all was measured worse: a worker that wakes first accepts a
whole burst of connections, and with keep-alive it keeps them.) The pool holds the sockets for its whole life
and gives a worker's to its successor: a worker that dies does not close it, so the connections waiting in
its queue, not yet accepted, are its successor's to answer rather than reset (those it had accepted are lost
with it). And the pool steers new connections to the sockets of the workers that serve (a BPF program on the
port's SO_REUSEPORT group, _Steering): while one serves, none waits for a worker starting, restarting or
draining. Each worker has its own health checks, admission limits and A/B results.

One more process of the pool, the index host (router/http/index_worker.py), holds the machine's one block
index: it follows the engines' KV events and answers the workers' lookups over a Unix socket in the pool's
private directory (router/index/index_host.py), so that the index's memory and ingest are paid once, not once
per worker, and each worker's routed requests are speculative entries for all. It serves no HTTP. When it is
down (restarting), the workers route without prefix knowledge until it is back; its restart rebuilds the index
as a router's restart does (the engines' replay buffers).

The workers count each other's requests in flight, and their flows' against flow control's limits, as
replicas do (router/upstreams/peer_sync.py): each publishes on an ipc:// endpoint in the pool's private
directory and follows the others'. With a shared store (the `shared` section) each worker also takes part
with the replicas on other hosts, as a peer of its own.

The pool forwards SIGHUP to every worker and the index host (each reloads the file; each also watches it);
one still starting ignores it, as it reads the file then. On SIGTERM or SIGINT the pool sends SIGTERM to each,
which drains as a lone router does; a worker whose pool dies gets SIGTERM too. A worker (or the index host)
that exits is restarted at once; one that keeps exiting soon after its start (a crash: a SIGKILL from the OOM
killer is one) waits 0.5 s, then twice as long each time. A death by a signal that asks a process to end
(SIGHUP, SIGTERM, SIGINT) is no crash. A worker that exits MAX_STARTUP_FAILURES times in a row before serving
ends the pool (exit 1) only when no other worker serves: a pool that still serves goes on, and tries again.
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
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import msgspec
from prometheus_client.multiprocess import mark_process_dead

from router.config import ConfigError, RouterConfig, load_config
from router.http.index_worker import run_index_host
from router.http.server import Worker, run_server
from router.upstreams.peer_sync import PeerEndpoints

log = logging.getLogger(__name__)

MAX_STARTUP_FAILURES = 5
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.5, 30.0
_SERVED_LONG_S = 60.0  # a worker that ran this long is restarted at once, whatever came before
_POLL_S = 0.1
_KILL_AFTER_S = 10.0  # past the drain: what the workers' own grace and cancellation need, and a margin
_BACKLOG = 2048  # uvicorn's
_ASKED_TO_END = frozenset({signal.SIGHUP, signal.SIGTERM, signal.SIGINT})  # a death by these is no crash

_SO_ATTACH_REUSEPORT_CBPF = 51  # Linux's; Python's socket module does not name it
# Classic BPF's A = a random number (at SKF_AD_OFF + SKF_AD_RANDOM), A %= K, if A == K (jump), return K.
_LOAD_RANDOM, _MODULO, _IF_EQUAL, _RETURN = (0x20, 0, 0, 0xFFFFF038), 0x94, 0x15, 0x06


class _Spec(msgspec.Struct, frozen=True):
    """What a worker is started with (one argument, JSON)."""

    config: str
    host: str
    port: int
    listener: int  # the descriptor of its socket, the pool's
    publish: str
    follow: list[str]
    ready_dir: str
    parent: int  # the pool's pid
    log_level: int
    index: str  # the Unix socket the index host answers on
    hosts_index: bool  # this one is the index host: it serves no HTTP, and has no listener


@dataclass
class _Slot:
    index: int
    listener: (
        socket.socket | None
    )  # for the pool's whole life, whichever worker accepts on it; None: the host
    process: subprocess.Popen[bytes] | None = None
    exits: int | None = None  # a descriptor readable once the process exited (a pidfd)
    served: bool = False
    started: float = 0.0
    restart_at: float = 0.0
    backoff_s: float = 0.0
    startup_failures: int = 0


def run_workers(config: RouterConfig, path: Path, host: str, port: int, workers: int) -> int:
    """Serve with workers processes until SIGTERM or SIGINT; config is path's, already validated. The exit
    code: 0 after a stop, 1 when the port or a worker cannot start."""
    with tempfile.TemporaryDirectory(prefix="kvroute-serve-") as private, contextlib.ExitStack() as held:
        root = Path(private)
        try:
            listeners = [held.enter_context(_bound(host, port)) for _ in range(workers)]
            for sock in listeners:  # in the slots' order, which is then their order in the port's group
                sock.listen(_BACKLOG)
        except OSError as exc:
            print(f"kvroute serve: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
            return 1
        endpoints = [f"ipc://{root}/peers-{i}" for i in range(workers)]
        pool = WorkerPool(config, path, (host, port), listeners, root, endpoints)
        return pool.run()


def _bound(host: str, port: int) -> socket.socket:
    """A worker's socket, bound as uvicorn binds its own, with SO_REUSEPORT."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Steering:
    """Which of the port's listening sockets the kernel gives new connections: a classic BPF program on their
    SO_REUSEPORT group returns one of the chosen sockets' indices there, at random. A socket's index is its
    place in the order they began listening, the slots' (run_workers), and stays so: no socket leaves the
    group while the pool serves. Where the kernel takes no program, its own even spread stays: a restarting
    worker's socket takes its share of new connections, which wait for the successor."""

    def __init__(self, member: socket.socket) -> None:
        self._member = member
        self._chosen: tuple[int, ...] | None = ()

    def to(self, indices: Sequence[int]) -> None:
        if self._chosen is None or tuple(indices) == self._chosen:
            return
        code = b"".join(struct.pack("HBBI", *step) for step in _one_of(indices))
        steps = ctypes.create_string_buffer(code)  # the kernel copies it during the call
        program = struct.pack("HP", len(code) // 8, ctypes.addressof(steps))
        try:
            self._member.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_REUSEPORT_CBPF, program)
        except OSError as exc:
            self._chosen = None
            log.warning("new connections cannot be steered to the workers that serve: %s", exc)
            return
        self._chosen = tuple(indices)


def _one_of(indices: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """The program: A random number modulo len(indices) picks one (a chain of comparisons, as classic BPF
    has no tables)."""
    steps = [_LOAD_RANDOM, (_MODULO, 0, 0, len(indices))]
    for position, index in enumerate(indices[:-1]):
        steps += [(_IF_EQUAL, 0, 1, position), (_RETURN, 0, 0, index)]
    return [*steps, (_RETURN, 0, 0, indices[-1])]


class WorkerPool:
    """The parent of `kvroute serve --workers N`: starts the workers, restarts those that exit, steers new
    connections to those that serve, passes signals on. (Not router/supervisor.py, which runs a process's
    background loops.)"""

    def __init__(
        self,
        config: RouterConfig,
        path: Path,
        address: tuple[str, int],
        listeners: list[socket.socket],
        root: Path,
        endpoints: list[str],
    ) -> None:
        """root: where the workers' metrics, readiness and the index host's socket are; endpoints: each
        worker's, which it publishes its load on."""
        self._config, self._path, (self._host, self._port) = config, path, address
        self._endpoints, self._index = endpoints, str(root / "index")
        self._metrics_dir, self._ready_dir = root / "metrics", root / "ready"
        self._metrics_dir.mkdir()
        self._ready_dir.mkdir()
        # The workers', then the index host's: a worker's slot index is its socket's place in the port's
        # group.
        self._slots = [_Slot(i, listener) for i, listener in enumerate([*listeners, None])]
        self._steering = _Steering(listeners[0])
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
            self._steer()
            self._announce()
            self._pause()

    def _pause(self) -> None:
        """_POLL_S, or less when a worker exits meanwhile: its socket is steered away from at once."""
        exits = [slot.exits for slot in self._slots if slot.exits is not None]
        select.select(exits, [], [], _POLL_S)

    def _start(self, slot: _Slot) -> None:
        hosts = slot.listener is None
        others = [e for i, e in enumerate(self._endpoints) if i != slot.index]
        fd = -1 if slot.listener is None else slot.listener.fileno()
        spec = _Spec(
            str(self._path),
            self._host,
            self._port,
            fd,
            "" if hosts else self._endpoints[slot.index],
            [] if hosts else others,
            str(self._ready_dir),
            os.getpid(),
            logging.getLogger().getEffectiveLevel(),
            self._index,
            hosts,
        )
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self._metrics_dir)}
        argv = [sys.executable, "-m", "router.http.workers", msgspec.json.encode(spec).decode()]
        # The worker inherits the blocked SIGHUP through exec: until its first line ignores it, a SIGHUP (the
        # pool's, passed on, or a terminal's hangup to the whole group) would end it. This thread's only: one
        # sent to the pool meanwhile reaches its handler through another thread, or waits.
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            slot.process = subprocess.Popen(argv, env=env, pass_fds=() if hosts else (fd,))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        with contextlib.suppress(OSError, AttributeError):  # without one, _pause sleeps its whole time
            slot.exits = os.pidfd_open(slot.process.pid)
        slot.started = time.monotonic()
        log.info("%s started: pid %d", _name(slot), slot.process.pid)

    def _exited(self, slot: _Slot, now: float) -> bool:
        """Schedule the worker's restart; False when it keeps failing to start and no other worker serves:
        the pool gives up."""
        assert slot.process is not None
        pid, code = slot.process.pid, slot.process.returncode
        slot.process = None
        if slot.exits is not None:
            os.close(slot.exits)
            slot.exits = None
        mark_process_dead(pid, str(self._metrics_dir))  # type: ignore[no-untyped-call]
        ready = self._ready_dir / str(pid)
        served, slot.served = slot.served or ready.exists(), False
        ready.unlink(missing_ok=True)
        serving = self._steer()
        delay = _restart_delay(slot, code, served, now)
        failed = f" before serving ({slot.startup_failures} in a row)" if slot.startup_failures else ""
        if slot.startup_failures >= MAX_STARTUP_FAILURES and not serving:
            log.error("%s exited with %s%s, and no worker serves: stopping", _name(slot), code, failed)
            return False
        slot.restart_at = now + delay
        log.warning(
            "%s (pid %d) exited with %s%s; restarting it in %.1f s",
            _name(slot),
            pid,
            code,
            failed,
            delay,
        )
        return True

    def _steer(self) -> list[int]:
        """New connections to the workers that serve, whose slots it returns; while none does, to every
        socket, where they wait."""
        listening = [slot for slot in self._slots if slot.listener is not None]
        serving = [slot.index for slot in listening if self._serves(slot)]
        self._steering.to(serving or [slot.index for slot in listening])
        return serving

    def _serves(self, slot: _Slot) -> bool:
        """Whether slot's worker accepts connections now: it made its ready file, and has not removed it."""
        if slot.process is None or slot.process.poll() is not None:
            return False
        serves = (self._ready_dir / str(slot.process.pid)).exists()
        slot.served |= serves
        return serves

    def _announce(self) -> None:
        if self._announced:
            return
        if all(self._serves(slot) for slot in self._slots):
            self._announced = True
            *workers, host = [slot.process.pid if slot.process else 0 for slot in self._slots]
            log.info(
                "%d workers serving on %s:%d, pids %s; the index host's pid %d",
                len(workers),
                self._host,
                self._port,
                " ".join(map(str, workers)),
                host,
            )

    def _signal_all(self, signum: int) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.send_signal(signum)

    def _stop(self) -> None:
        """SIGTERM every worker, and wait for them to drain; a further SIGTERM or SIGINT asks them to end at
        once (as SIGINT, which uvicorn takes for a second), and SIGKILL ends those left past the grace. A
        socket whose worker no longer accepts refuses new connections from then on."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self._config.shutdown_grace_s + _KILL_AFTER_S
        running = [slot.process for slot in self._slots if slot.process is not None]
        while any(process.poll() is None for process in running) and time.monotonic() < deadline:
            for slot in self._slots:
                if slot.listener is not None and not self._serves(slot):
                    _stop_listening(slot.listener)
            if any(signum != signal.SIGHUP for signum in self._signals):
                self._signals.clear()
                self._signal_all(signal.SIGINT)
            time.sleep(_POLL_S)
        for process in running:
            if process.poll() is None:
                log.warning("worker pid %d still running after the grace period: killed", process.pid)
                process.kill()
                process.wait()
        for slot in self._slots:
            if slot.exits is not None:
                os.close(slot.exits)


def _stop_listening(sock: socket.socket) -> None:
    """Takes sock out of the port's group, though its worker may hold it open too: what waits in its queue is
    reset (moved to the others' queues, under Linux's net.ipv4.tcp_migrate_req), and new connections go to
    the others, or are refused. Only once its worker has closed its own listener: uvloop takes an error on
    the socket it polls for a fatal one."""
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.shutdown(socket.SHUT_RD)  # on a listening socket only: on another it would end the reading


def _restart_delay(slot: _Slot, code: int, served: bool, now: float) -> float:
    """How soon slot's worker, exited with code, starts again; its failures counted. A death by a signal that
    asks a process to end is neither a crash nor a failure to start. Any other exit before serving is a
    failure to start; any soon after the start, a crash (the OOM killer's SIGKILL among them), doubles the
    wait for the next."""
    if -code in _ASKED_TO_END:
        return 0.0
    slot.startup_failures = 0 if served else slot.startup_failures + 1
    if now - slot.started > _SERVED_LONG_S:
        slot.backoff_s = 0.0
    delay = slot.backoff_s
    slot.backoff_s = min(max(2 * delay, _FIRST_BACKOFF_S), _MAX_BACKOFF_S)
    return delay


def _name(slot: _Slot) -> str:
    return "the index host" if slot.listener is None else f"worker {slot.index}"


def _worker(spec: _Spec) -> int:
    _end_with(spec.parent)
    path = Path(spec.config)
    try:
        config = load_config(path)
        config.require_api_keys(spec.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    ready = Path(spec.ready_dir) / str(os.getpid())
    if spec.hosts_index:
        run_index_host(config, path, spec.index, ready)
        return 0
    peers = PeerEndpoints(spec.publish, tuple(spec.follow))
    listener = socket.socket(fileno=spec.listener)
    run_server(config, spec.host, spec.port, path, Worker(listener, peers, ready, spec.index))
    return 0


def _end_with(parent: int) -> None:
    """SIGTERM this worker when its pool dies, killed even (Linux's PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _ignore_hangups() -> None:
    """SIGHUP, blocked since the pool started this process, ignored until the reloader takes it: the file is
    read at the start, and the reloader's first look reloads it when it changed meanwhile, so an earlier
    SIGHUP has nothing to add. (Ignoring it discards one that waits.)"""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


if __name__ == "__main__":
    _ignore_hangups()
    worker_spec = msgspec.json.decode(sys.argv[1], type=_Spec)
    logging.basicConfig(
        level=worker_spec.log_level,
        format="%(asctime)s %(levelname)s %(name)s [worker %(process)d]: %(message)s",
    )
    sys.exit(_worker(worker_spec))
