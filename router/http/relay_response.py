"""The response that relays an answer as it arrives (a stream, a whole answer too long to hold) to its
client: cleaned up however it ends, cut off when the client takes nothing for too long, and its connection
closed when the answer breaks off where the client could not tell."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import NamedTuple

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from router.dispatch.answer.relay import RelayBroken


class Head(NamedTuple):
    """What an answer starts with."""

    status: int
    raw_headers: list[tuple[bytes, bytes]]
    media_type: str


class RelayResponse(StreamingResponse):
    """An answer whose cleanup runs however it ends: completed, client gone, or never started. A client that
    takes nothing for send_timeout_s is cut off: it would hold its admission slot, its instance's place and
    the engine's request for as long as it likes."""

    def __init__(
        self,
        relay: AsyncGenerator[bytes, None],
        finish: Callable[[], None],
        head: Head,
        send_timeout_s: float,
        stalled: Callable[[], None],
    ) -> None:
        super().__init__(relay, head.status, media_type=head.media_type)
        self.raw_headers.extend(head.raw_headers)  # bytes as the engine sent them, not text re-encoded
        self._relay, self._finish = relay, finish
        self._send_timeout_s, self._stalled = send_timeout_s, stalled

    async def stream_response(self, send: Send) -> None:
        # One watchdog a stream, looking every send_timeout_s, not a timer a chunk: a long answer sends
        # thousands of chunks, and a timer each cost more CPU than the routing decision.
        loop, limit = asyncio.get_running_loop(), self._send_timeout_s
        sending_since: float | None = None
        watchdog: asyncio.TimerHandle | None = None

        async def send_watched(message: Message) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            await send(message)
            sending_since = None

        try:
            async with asyncio.timeout(None) as guard:

                def look() -> None:
                    nonlocal watchdog
                    now = loop.time()
                    if sending_since is not None and now - sending_since >= limit:
                        guard.reschedule(now)  # the send waiting for the client is cancelled
                    else:
                        waited = 0.0 if sending_since is None else now - sending_since
                        watchdog = loop.call_later(limit - waited, look)

                watchdog = loop.call_later(limit, look)
                try:
                    await super().stream_response(send_watched)
                finally:
                    watchdog.cancel()
        except TimeoutError:
            # Returning unfinished makes the server close the connection, and the relay's end aborts the
            # engine's request.
            self._stalled()
        except RelayBroken:
            pass  # unfinished too: the client sees a body cut short, not one that looks whole

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._relay.aclose()
            self._finish()
