"""A client that leaves before its answer begins cancels the work done for it."""

from __future__ import annotations

import asyncio

from starlette.types import Receive

_WATCH_AFTER_S = 0.05  # a request still routing or waiting for its first byte after this watches its client


class ClientWatch:
    """Cancels the task that opens it when the client disconnects, until it is closed: a client that leaves
    while its request waits for a slot, is routed or waits for its first byte must not keep an engine
    computing for no one."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task = asyncio.current_task()
        self._left = self._closed = False
        self._watcher: asyncio.Task[None] | None = None
        self._starting: asyncio.TimerHandle | None = None

    def __enter__(self) -> ClientWatch:
        # A timer, not a task, for the requests done within it (most of a fast fleet's): a task per request
        # cost ~10% of the router's CPU per request; a client gone that early loses an engine little.
        self._starting = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, self._start)
        return self

    def __exit__(self, *exc: object) -> None:
        # No await between the work's end and here, so the watcher cannot cancel what has finished.
        self._closed = True
        if self._starting is not None:
            self._starting.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    def _start(self) -> None:
        if not self._closed:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def client_left(self) -> bool:
        """The cancellation came from here: undo its count on the task, which goes on to answer."""
        if self._left and self._task is not None:
            self._task.uncancel()
        return self._left

    async def _watch(self) -> None:
        # The body has been read, so the server has nothing more to give but the disconnect.
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._closed and self._task is not None:
            self._left = True
            self._task.cancel()
