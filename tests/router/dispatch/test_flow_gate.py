"""Flow control on the event loop (router/dispatch/flow_gate.py): the waiters room appears for are let go
together, not one per placement."""

from __future__ import annotations

import asyncio

from router.config import parse_config
from router.dispatch.flow_gate import FlowTicket
from router.runtime import Runtime

MODEL = "tiny-llama"
SATURATING_TOKENS = 10_000_000  # queued prefill no engine_queue_s admits


def test_the_waiters_room_appears_for_are_let_go_together() -> None:
    """Eight requests wait while the instance is saturated. When it empties, one pump lets all of them go
    before any is placed (one at a time, each waited three turns of the loop for the one before it to be
    placed, and a queue that formed under load never emptied); once they are placed, an arrival goes at once."""
    raw = {"models": [{"name": MODEL}], "instances": [{"name": "a", "url": "http://127.0.0.1:9"}]}
    runtime = Runtime(parse_config(raw))
    gate, instance = runtime.flow_gate, runtime.upstreams.instances[0]

    async def main() -> None:
        instance.own_pending_prefill_tokens = SATURATING_TOKENS
        waiting = [asyncio.create_task(gate.wait(MODEL, f"flow-{n}", None, 10.0, 100)) for n in range(8)]
        await asyncio.sleep(0)
        assert gate.control.queued() == 8
        instance.own_pending_prefill_tokens = 0
        gate.pump()
        done, _ = await asyncio.wait(waiting, timeout=5)
        assert len(done) == 8 and gate.control.queued() == 0
        tickets = [task.result() for task in waiting]
        assert all(isinstance(t, FlowTicket) and t.granted for t in tickets)
        for ticket in tickets:
            gate.started(ticket)
        await asyncio.sleep(0)  # started() places each with call_soon
        arrival = await gate.wait(MODEL, "late", None, 10.0, 100)
        assert arrival is not None and not arrival.granted and arrival.entry is None
        for ticket in [*tickets, arrival]:
            gate.leave(ticket)

    asyncio.run(main())
