"""Threads of the router's own, which leave the signals it handles to the main thread.

The kernel hands a signal sent to the process to any thread that does not block it. The main thread blocks
SIGHUP for a moment while it turns its handler into "ignored" at shutdown (router/reload.py): a SIGHUP sent
then could go to a worker thread and get the default action, set for that moment, which ends the process (a
run of tests/scenarios/test_signals.py once ended that way). Blocked in every worker thread, each of these
signals waits for the main thread, whose handlers and masks decide what it does.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

HANDLED = frozenset({signal.SIGHUP, signal.SIGTERM, signal.SIGINT})


def leave_signals_to_the_main_thread() -> None:
    """Blocks HANDLED in the calling thread, for good."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)


def executor(max_workers: int | None = None, name: str = "kvroute") -> ThreadPoolExecutor:
    """A thread pool whose threads block HANDLED."""
    return ThreadPoolExecutor(max_workers, name, initializer=leave_signals_to_the_main_thread)
