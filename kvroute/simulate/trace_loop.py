"""asyncio on the trace's clock: the router's own coroutines (router/dispatch/conductor.py) run in simulated
time, their callbacks and timers in the discrete-event loop's one order with the engines' steps.

asyncio's own loops wait on a selector and order same-time timers by a heap that does not keep their order;
this one hands every callback to kvroute/simulate/clock.py's EventLoop: a ready one (call_soon, a future's
callbacks, a task's steps) before any timed one, as asyncio runs them, and timers by (time, order of
scheduling), so a run repeats exactly. Time passes only between events: a coroutine that sleeps or times out
wakes at its simulated time, however long that is.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

from kvroute.simulate.clock import EventLoop

T = TypeVar("T")


class TraceLoop(asyncio.AbstractEventLoop):
    """The asyncio loop the simulated routers' coroutines run on: callbacks at the clock's times."""

    def __init__(self, clock: EventLoop) -> None:
        self._clock = clock
        self._failures: list[dict[str, Any]] = []
        self._running = False

    # -- what futures, tasks, sleeps and timeouts use --------------------------------------------------
    def time(self) -> float:
        return self._clock.now

    def call_soon(  # type: ignore[override]
        self, callback: Callable[..., object], *args: Any, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        self._clock.soon(lambda: _run(handle))
        return handle

    def call_later(  # type: ignore[override]
        self,
        delay: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        return self.call_at(self._clock.now + delay, callback, *args, context=context)

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, args, self, context)
        self._clock.at(when, lambda: _run(handle))
        return handle

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        """A cancelled timer stays in the clock's heap and does nothing when its time comes."""

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(
        self,
        coro: Coroutine[Any, Any, T] | Generator[Any, None, T],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        return asyncio.Task(coro, loop=self, name=name, context=context)

    def get_debug(self) -> bool:
        return False

    def is_running(self) -> bool:
        return self._running

    def is_closed(self) -> bool:
        return False

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        """An exception no one awaited (a callback's, a task's once it is collected): the run fails with it,
        at once from a callback."""
        self._failures.append(context)
        if self._running:
            raise SimulatedRouterFailed(context.get("message", "")) from context.get("exception")

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        self.call_exception_handler(context)

    # -- running -----------------------------------------------------------------------------------------
    def run(self) -> None:
        """Run the clock until no event is left, with this loop as the running one meanwhile (what
        asyncio.get_running_loop() gives the router's code); a failure no one awaited is raised at the end."""
        self._running = True
        outer = asyncio.events._get_running_loop()  # a simulation run from a coroutine (bench calibrate)
        asyncio.events._set_running_loop(self)
        try:
            self._clock.run()
        finally:
            asyncio.events._set_running_loop(outer)
            self._running = False
        if self._failures:
            context = self._failures[0]
            raise SimulatedRouterFailed(context.get("message", "")) from context.get("exception")


class SimulatedRouterFailed(RuntimeError):
    """A simulated router's code raised where nothing awaited it."""


def _run(handle: asyncio.Handle) -> None:
    if not handle.cancelled():
        handle._run()
