"""A stall probe for `kvroute serve`: when its event loop is held, how long, by what, and whose time it was.

Not part of the router: put this directory first on PYTHONPATH of a process that starts `kvroute serve` (the
router inherits it; in any other process this does nothing) and name a directory for its report:

    KVROUTE_STALL_PROBE=/tmp/probe PYTHONPATH=scripts/stall_probe:. \
        .venv/bin/python scripts/measure_requests_during_burst.py --blocks 2000000

A callback on the loop every 2 ms reads the main thread's CPU time (user and system, getrusage), its time
waiting for a CPU (/proc/thread-self/schedstat) and its page faults. A beat late by more than
KVROUTE_STALL_PROBE_OVER_MS (15 by default) is a stall, split into: run (user + system: the loop's own
work, system time being page faults and syscalls), waiting for a CPU (other processes had the cores), and the
rest (the thread slept: the GIL held by another thread, a blocking call). Meanwhile a watchdog thread
samples the main thread's stack every 2 ms (a compiled call that holds the GIL throughout is seen once, as it
ends: the stall's system time then says whether it was faulting pages in). At shutdown stalls-PID.txt lists
each stall with the stacks seen in it (their innermost frames); stalls-PID.json has them whole.
"""

import os
import sys

_DIR = os.environ.get("KVROUTE_STALL_PROBE")
if _DIR and "serve" in sys.argv:
    import asyncio
    import atexit
    import collections
    import json
    import resource
    import socket
    import threading
    import time
    import traceback

    import uvicorn

    _OVER_S = float(os.environ.get("KVROUTE_STALL_PROBE_OVER_MS", "15")) / 1e3
    _EVERY_S = 0.002
    _MAIN = threading.get_ident()  # sitecustomize is imported on the main thread
    _REPORTS: str = _DIR
    _last_beat: list[float] = []  # the latest beat's time, once the loop runs
    _stalls: list[dict[str, float]] = []
    _samples: list[tuple[float, str]] = []  # (when, the main thread's stack) while no beat came
    _schedstat = open("/proc/thread-self/schedstat", "rb", buffering=0)  # the main thread's: opened here

    def _reading() -> tuple[float, ...]:
        """(now, CPU run time, time waiting for a CPU, user, system, minor faults) of the main thread."""
        _schedstat.seek(0)
        run_ns, wait_ns, _ = _schedstat.read().split()
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return (time.monotonic(), int(run_ns) / 1e9, int(wait_ns) / 1e9, usage.ru_utime, usage.ru_stime,
                usage.ru_minflt)  # fmt: skip

    def _beat(loop: asyncio.AbstractEventLoop, due: float, before: tuple[float, ...]) -> None:
        now = _reading()
        if now[0] - due > _OVER_S:
            wall, run, waited, user, system, faults = (b - a for a, b in zip(before, now, strict=True))
            _stalls.append({
                "at": now[0], "late_ms": (now[0] - due) * 1e3, "wall_ms": wall * 1e3, "run_ms": run * 1e3,
                "cpu_wait_ms": waited * 1e3, "rest_ms": (wall - run - waited) * 1e3, "user_ms": user * 1e3,
                "system_ms": system * 1e3, "page_faults": faults, "since": before[0],
            })  # fmt: skip
        _last_beat[:] = [now[0]]
        loop.call_later(_EVERY_S, _beat, loop, now[0] + _EVERY_S, now)

    def _watch() -> None:
        while True:
            time.sleep(_EVERY_S)
            if _last_beat and time.monotonic() - _last_beat[0] > _OVER_S:
                frame = sys._current_frames().get(_MAIN)
                if frame is not None:
                    _samples.append((time.monotonic(), "".join(traceback.format_stack(frame))))

    def _report() -> None:
        if not _stalls:
            return
        stacks = [
            collections.Counter(stack for at, stack in _samples if stall["since"] <= at <= stall["at"])
            for stall in _stalls
        ]
        path = os.path.join(_REPORTS, f"stalls-{os.getpid()}")
        with open(path + ".json", "w") as out:
            whole = [
                {**stall, "stacks": seen.most_common()} for stall, seen in zip(_stalls, stacks, strict=True)
            ]
            json.dump(whole, out)
        with open(path + ".txt", "w") as out:
            for stall, seen in zip(_stalls, stacks, strict=True):
                out.write(
                    "late {late_ms:.1f} ms: run {run_ms:.1f} (user {user_ms:.1f}, system {system_ms:.1f}, "
                    "{page_faults} page faults), waiting for a CPU {cpu_wait_ms:.1f}, "
                    "rest {rest_ms:.1f}\n".format(**stall)
                )
                for stack, count in seen.most_common():
                    innermost = [
                        line.strip() for line in stack.splitlines() if line.strip().startswith("File")
                    ]
                    out.write(f"    {count} x " + " < ".join(reversed(innermost[-4:])) + "\n")

    _startup = uvicorn.Server.startup
    _shutdown = uvicorn.Server.shutdown

    async def _probed_startup(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(_beat, loop, time.monotonic(), _reading())
        threading.Thread(target=_watch, name="stall-probe", daemon=True).start()
        return await _startup(self, sockets)

    async def _probed_shutdown(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        _report()
        return await _shutdown(self, sockets)

    setattr(uvicorn.Server, "startup", _probed_startup)  # noqa: B010 (mypy refuses a method assigned)
    setattr(uvicorn.Server, "shutdown", _probed_shutdown)  # noqa: B010
    atexit.register(_report)
