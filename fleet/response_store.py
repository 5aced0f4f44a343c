"""One simulated instance's store of Responses API responses, as vLLM 0.32 keeps it in its API server.

vLLM stores only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``: ``response_store`` (each response by id: put when
a background run is queued, replaced when a run ends), ``msg_store`` (the chat messages a response was
rendered from, put when it starts: a later ``previous_response_id`` continues from them), ``event_store`` (a
background stream's events, for ``GET /v1/responses/{id}?stream=true``) and the background tasks.

vLLM never evicts. Here the store holds at most ``capacity`` responses and drops the oldest (with its messages
and events) past that, so a long-running fleet stays bounded; a follow-up naming a dropped response gets the
same 404 as one naming an unknown id.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CAPACITY = 1024


@dataclass(eq=False)
class EventLog:
    """A background stream's events, in order, for readers that follow it live."""

    events: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def append(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._changed.set()

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    async def follow(self, start: int) -> AsyncIterator[dict[str, Any]]:
        """From event start on, until response.completed, or until the run ended without one (cancelled:
        vLLM's reader would wait forever)."""
        index = start
        while True:
            self._changed.clear()
            while index < len(self.events):
                event = self.events[index]
                yield event
                if event["type"] == "response.completed":
                    return
                index += 1
            if self.ended:
                return
            await self._changed.wait()


@dataclass(eq=False)
class _Entry:
    messages: list[dict[str, Any]] | None = None
    response: dict[str, Any] | None = None
    events: EventLog | None = None


class ResponseStore:
    """enabled: vLLM's VLLM_ENABLE_RESPONSES_API_STORE; disabled, nothing is ever stored or found."""

    def __init__(self, enabled: bool = True, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("the response store holds at least one response")
        self.enabled, self.capacity = enabled, capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def background_runs(self) -> int:
        return len(self._tasks)

    def response(self, response_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry.response

    def messages(self, response_id: str) -> list[dict[str, Any]] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry.messages

    def events(self, response_id: str) -> EventLog | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry.events

    def _entry(self, response_id: str) -> _Entry:
        entry = self._entries.get(response_id)
        if entry is None:
            entry = self._entries[response_id] = _Entry()
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return entry

    def put_messages(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        """What a response is rendered from, kept when it starts."""
        self._entry(response_id).messages = messages
        self._entries.move_to_end(response_id)

    def put(self, response: dict[str, Any]) -> None:
        """Stores or replaces a response, unless the stored one was cancelled (a cancelled run's end does
        not overwrite it, as in vLLM)."""
        entry = self._entry(response["id"])
        if entry.response is None or entry.response["status"] != "cancelled":
            entry.response = response

    def start_events(self, response_id: str) -> EventLog:
        log = self._entry(response_id).events = EventLog()
        return log

    def run_in_background(self, response_id: str, run: asyncio.Task[None]) -> None:
        self._tasks[response_id] = run
        run.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    async def cancel(self, response_id: str) -> None:
        """Stops a background run and waits for it to be gone."""
        run = self._tasks.get(response_id)
        if run is None:
            return
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)

    async def close(self) -> None:
        """Cancels every background run (the instance is stopping)."""
        runs = list(self._tasks.values())
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
