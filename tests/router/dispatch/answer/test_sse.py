"""Relaying whole server-sent events: a partial one is held until it completes, and a stream that ends with
one held broke off."""

from __future__ import annotations

import pytest

from router.dispatch.answer.sse import EventFramer

EVENT = b'data: {"choices":[{"text":"a"}]}\n\n'


@pytest.mark.parametrize(
    ("chunks", "relayed", "held"),
    [
        ([EVENT, EVENT], [EVENT, EVENT], b""),
        ([EVENT + EVENT[:10], EVENT[10:]], [EVENT, EVENT], b""),
        ([EVENT[:5], EVENT[5:20], EVENT[20:]], [b"", b"", EVENT], b""),
        ([EVENT, b"data: [DO"], [EVENT, b""], b"data: [DO"),
        ([b"data: x\r\n\r\ndata: y"], [b"data: x\r\n\r\n"], b"data: y"),
    ],
)
def test_only_complete_events_are_relayed(chunks: list[bytes], relayed: list[bytes], held: bytes) -> None:
    framer = EventFramer()
    assert [framer.whole(chunk) for chunk in chunks] == relayed
    assert framer.unfinished() == bool(held)


def test_an_upstream_that_never_ends_an_event_is_relayed_as_it_comes() -> None:
    framer = EventFramer()
    huge = b"data: " + b"x" * (1 << 20)
    assert framer.whole(huge) == huge and framer.unfinished()  # what went out ends in an event's middle
    assert framer.whole(b"x\n\n") == b"x\n\n" and not framer.unfinished()
