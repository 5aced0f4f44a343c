"""The router's worker threads leave the signals it handles to the main thread (router/worker_threads.py):
one taken by a worker thread while the main thread blocks it would get its default action there."""

from __future__ import annotations

import asyncio
import signal

from router import worker_threads
from router.config import parse_config
from router.runtime import Runtime


def _blocked_here() -> set[signal.Signals]:
    return signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_a_pool_s_threads_block_the_handled_signals_and_the_caller_s_stay_as_they_were() -> None:
    before = _blocked_here()
    with worker_threads.executor(2) as pool:
        masks = [pool.submit(_blocked_here).result() for _ in range(4)]
    assert all(worker_threads.HANDLED <= mask for mask in masks)
    assert _blocked_here() == before


def test_what_a_running_router_does_off_its_loop_runs_with_the_handled_signals_blocked() -> None:
    down = {"name": "down", "url": "http://127.0.0.1:9"}  # nothing listens: nothing routed
    raw = {"models": [{"name": "m", "tokenizer": "builtin:tiny-llama"}], "instances": [down]}

    async def main() -> set[signal.Signals]:
        async with Runtime(parse_config(raw)):
            return await asyncio.to_thread(_blocked_here)

    assert worker_threads.HANDLED <= asyncio.run(main())
