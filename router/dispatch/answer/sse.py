"""Server-sent events relayed whole: when a stream breaks in the middle of an event, the half already received
is dropped, so that the client never parses it glued to the router's error event."""

from __future__ import annotations

_MAX_HELD = 1 << 20  # an upstream that never ends an event is relayed as it comes, not held without bound


class EventFramer:
    def __init__(self) -> None:
        self._held = b""
        self.cut_open = False  # what went to the client ends in the middle of an event (one past _MAX_HELD)

    def whole(self, chunk: bytes) -> bytes:
        """The complete events received so far; what follows the last one is held until it completes."""
        if self._held:
            chunk, self._held = self._held + chunk, b""
        if chunk.endswith(b"\n\n"):  # the common case: engines write whole events
            self.cut_open = False
            return chunk
        cut = max(_end_of(chunk, b"\n\n"), _end_of(chunk, b"\r\n\r\n"), 0)
        if len(chunk) - cut > _MAX_HELD:
            self.cut_open = True
            return chunk
        self._held = chunk[cut:]
        if cut:
            self.cut_open = False
        return chunk[:cut]

    def unfinished(self) -> bool:
        """Whether an event was begun and not ended: a stream that ends there broke off in its middle (a
        client drops an event its stream ends in, and the engine ends every event it sends)."""
        return self.cut_open or bool(self._held.strip())


def _end_of(data: bytes, boundary: bytes) -> int:
    found = data.rfind(boundary)
    return -1 if found < 0 else found + len(boundary)
