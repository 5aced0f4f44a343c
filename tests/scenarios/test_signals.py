"""SIGHUP never ends `kvroute serve`, alone or with workers, or `kvroute epp`, whatever phase of its life it
comes in: from its first line on, all through the start-up (imports, tokenizer, the app's startup, each
worker's own start, which begins with SIGHUP blocked), while it serves (it reloads), and during the shutdown
(the exit is SIGTERM's). And the pool counts no death by a signal that asks a process to end as a failure to
start, while one worker's deaths at start-up by SIGKILL (as the OOM killer sends) back off without ending a
pool whose other worker serves.

(The interpreter's own start, about 0.1 s, comes before any line of kvroute's: a SIGHUP then ends it, as it
would any program; a parent can spare its child that, as the pool spares its workers.)"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvroute.processes import Child, FleetPorts, free_port_block, http_ok, start
from router.http.workers import MAX_STARTUP_FAILURES
from tests.scenarios.test_serve_workers import start_workers
from tests.scenarios.test_shutdown import EXITED_ON_SIGTERM
from tests.support.signalling import Hangups, Pinger, alive, new_worker, serving, sighup_taken
from tests.support.waiting import eventually


@dataclass(frozen=True)
class _Command:
    args: list[str]  # after the configuration's and the port's
    exit_code: int  # on SIGTERM
    reloads: bool  # logs its reloads (the endpoint picker's reload is router/epp's)

    def start(self, fleet: FleetPorts, tmp_path: Path) -> tuple[Child, str]:
        """The process, and the URL that answers once it serves."""
        config = tmp_path / "router.yaml"
        config.write_text(yaml.safe_dump(fleet.router_config()))
        port = free_port_block(2)
        argv = [*self.args[:1], "--config", str(config), "--port", str(port), *self.args[1:]]
        if self.args[0] == "epp":
            argv += ["--metrics-port", str(port + 1)]
            return start("epp", argv, tmp_path), f"http://127.0.0.1:{port + 1}/metrics"
        return start("router", argv, tmp_path), f"http://127.0.0.1:{port}/health"


def _log(child: Child) -> str:
    return child.log_path.read_text(errors="replace")


def _serves(child: Child, url: str, command: _Command) -> bool:
    return http_ok(url) and ("--workers" not in command.args or "2 workers serving on" in _log(child))


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(_Command(["serve"], EXITED_ON_SIGTERM, True), id="alone"),
        pytest.param(_Command(["serve", "--workers", "2"], 0, True), id="workers"),
        pytest.param(_Command(["epp"], 0, False), id="epp"),
    ],
)
def test_sighup_at_every_phase_neither_ends_it_nor_stops_it_serving(
    fleet: FleetPorts, tmp_path: Path, command: _Command
) -> None:
    child, url = command.start(fleet, tmp_path)
    group = child.process.pid
    try:
        eventually(lambda: sighup_taken(group) or child.process.poll() is not None, 60, "SIGHUP taken")
        threads = sighup_taken(group)
        # To the whole group, as a terminal's hangup: the pool, and each worker from its spawn on.
        with Hangups(group) as hangups:
            eventually(
                lambda: child.process.poll() is not None or _serves(child, url, command), 120, "serving"
            )
        assert child.process.poll() is None, f"ended by a SIGHUP at start-up:\n{child.log_tail()}"
        # Taken from its first line: before the start-up's work, which soon starts threads.
        assert threads == 1, f"SIGHUP taken late, or never: {threads} threads then"
        assert hangups.sent >= 3
        for _ in range(3):
            os.killpg(group, signal.SIGHUP)
            assert http_ok(url)
        if command.reloads:
            eventually(lambda: "configuration reloaded on SIGHUP" in _log(child), 30, "a reload on SIGHUP")
        child.process.send_signal(signal.SIGTERM)
        with Hangups(group):
            assert child.wait(90) == command.exit_code, child.log_tail()
        assert "exited with" not in _log(child)  # no worker died
    finally:
        child.stop()


def test_a_worker_ended_while_starting_is_no_failure_to_start(fleet: FleetPorts, tmp_path: Path) -> None:
    """SIGTERM, once more than the failures a pool takes, each time to the worker starting in the place of the
    last one: each is restarted at once, and the other worker serves all along."""
    served = start_workers(fleet, tmp_path, "ended")
    pool, port = served.child, int(served.url.rpartition(":")[2])
    try:
        known = served.workers()
        healthy, ended = sorted(known)
        os.kill(ended, signal.SIGTERM)  # it drains first
        eventually(lambda: "exited with -15" in _log(pool), 60, "the pool seeing it")
        with Pinger(port) as pinger:
            for _ in range(MAX_STARTUP_FAILURES + 1):
                ended = new_worker(pool, known)
                known.add(ended)
                assert not serving(ended)  # (it takes seconds to start)
                os.kill(ended, signal.SIGTERM)
            last = new_worker(pool, known)
            eventually(lambda: serving(last), 120, "the last one serving")
        assert pool.process.poll() is None, pool.log_tail()
        assert alive(healthy)
        assert _log(pool).count("exited with -15; restarting it in 0.0 s") == MAX_STARTUP_FAILURES + 2
        assert pinger.results and not pinger.failures(), pinger.results
    finally:
        pool.stop()


def test_a_worker_killed_while_starting_backs_off_but_the_pool_serves_on(
    fleet: FleetPorts, tmp_path: Path
) -> None:
    """A worker SIGKILLed as it starts, MAX_STARTUP_FAILURES times in a row: a crash each time, restarted later
    and later; its pool, whose other worker serves, goes on, and tries again."""
    served = start_workers(fleet, tmp_path, "killed")
    pool, port = served.child, int(served.url.rpartition(":")[2])
    try:
        known = served.workers()
        healthy, killed = sorted(known)
        os.kill(killed, signal.SIGKILL)  # served: restarted at once
        eventually(lambda: "exited with -9" in _log(pool), 30, "the pool seeing it")
        with Pinger(port) as pinger:
            for _ in range(MAX_STARTUP_FAILURES):
                killed = new_worker(pool, known)
                known.add(killed)
                assert not serving(killed)
                os.kill(killed, signal.SIGKILL)
            gave_up = f"before serving ({MAX_STARTUP_FAILURES} in a row); restarting it in 8.0 s"
            eventually(lambda: gave_up in _log(pool), 30, "the last failure counted")
            assert pool.process.poll() is None, pool.log_tail()
            last = new_worker(pool, known, 60)
            eventually(lambda: serving(last), 120, "the slot serving again")
        assert alive(healthy)
        for delay in ("0.0", "0.5", "1.0", "2.0", "4.0", "8.0"):
            assert f"restarting it in {delay} s" in _log(pool)
        assert pinger.results and not pinger.failures(), pinger.results
        assert pinger.workers() <= {healthy, last}
    finally:
        pool.stop()
