"""`kvroute serve --workers 2` when a worker is SIGKILLed: the connections waiting in its socket's accept queue
are its successor's to answer, not reset (the pool holds the socket); new connections meanwhile go to the
other worker, which serves all along, none to the dead one's socket (the pool steers them).

A worker is stopped (SIGSTOP) before it is killed, so that connections wait in its queue for certain: one
busy with others would have some there too, at times. Requests it had accepted would be lost with it, by
nature: none is in flight here."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from kvroute.processes import FleetPorts
from tests.scenarios.test_serve_workers import start_workers
from tests.support.signalling import Requests, accept_queue, alive, new_worker, serving
from tests.support.waiting import eventually


def test_a_killed_workers_queued_connections_are_answered_and_new_ones_go_to_the_other(
    fleet: FleetPorts, tmp_path: Path
) -> None:
    served = start_workers(fleet, tmp_path, "faults")
    pool, port = served.child, int(served.url.rpartition(":")[2])
    stopped: list[int] = []
    try:
        healthy, victim = sorted(served.workers())
        os.kill(victim, signal.SIGSTOP)
        stopped.append(victim)
        queued = Requests(port, 24, "queued")
        # Each request either answered by the other worker or waiting in the stopped one's queue.
        eventually(lambda: queued.answered() + accept_queue(port, victim) == 24, 60, "every request placed")
        waiting = accept_queue(port, victim)
        assert waiting, "none reached the stopped worker"  # each does at even odds
        os.kill(victim, signal.SIGKILL)
        eventually(lambda: "exited with -9; restarting it in" in pool.log_path.read_text(), 30, "exit seen")
        successor = new_worker(pool, {healthy, victim})
        os.kill(successor, signal.SIGSTOP)  # held before it serves, as long as the burst lasts
        stopped.append(successor)
        assert not serving(successor)
        burst = Requests(port, 32, "burst").wait(
            60
        )  # were any sent to the dead one's socket, they would wait
        assert burst == [("200", healthy)] * 32
        os.kill(successor, signal.SIGCONT)
        answers = queued.wait(120)
        assert [outcome for outcome, _ in answers if outcome != "200"] == []  # not reset
        assert sum(worker == successor for _, worker in answers) == waiting
        assert alive(healthy)
        assert pool.process.poll() is None
    finally:
        for pid in stopped:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
        pool.stop()
