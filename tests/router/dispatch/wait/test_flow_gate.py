"""Flow control on the event loop (router/dispatch/wait/flow_gate.py): the waiters room appears for are let go
together, not one per placement; the per-flow gauge follows the flows queued now."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from router.config import parse_config
from router.dispatch.context import FlowTicket
from router.dispatch.wait.flow_control import Demand
from router.dispatch.wait.flow_gate import FLOW_LABEL_CHARS, FLOW_SERIES, OTHER_FLOWS
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
        waiting = [
            asyncio.create_task(gate.wait(Demand(MODEL, f"flow-{n}", None, 10.0, 100))) for n in range(8)
        ]
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
        arrival = await gate.wait(Demand(MODEL, "late", None, 10.0, 100))
        assert arrival is not None and not arrival.granted and arrival.entry is None
        for ticket in [*tickets, arrival]:
            gate.leave(ticket)

    asyncio.run(main())


def _queued_by_flow(runtime: Runtime) -> dict[str, float]:
    """kvroute_flow_control_flow_queued's series, as a scrape reads them."""
    families = text_string_to_metric_families(runtime.metrics.render().decode())
    family = next(f for f in families if f.name == "kvroute_flow_control_flow_queued")
    return {s.labels["flow"]: s.value for s in family.samples}


def test_the_per_flow_gauge_shows_the_flows_queued_now_and_counts_the_rest_together() -> None:
    """The first 100 flows to queue get a series, the rest are counted under "other"; a flow's series goes
    when its queue empties, so flows that queue later get theirs (they never did once 100 had been seen),
    and a long name is cut to a bounded label."""
    raw = {"models": [{"name": MODEL}], "instances": [{"name": "a", "url": "http://127.0.0.1:9"}]}
    runtime = Runtime(parse_config(raw))
    gate, instance = runtime.flow_gate, runtime.upstreams.instances[0]

    async def queue_and_drain(flows: list[str]) -> dict[str, float]:
        instance.own_pending_prefill_tokens = SATURATING_TOKENS
        waiting = [asyncio.create_task(gate.wait(Demand(MODEL, flow, None, 10.0, 100))) for flow in flows]
        await asyncio.sleep(0)
        seen = _queued_by_flow(runtime)
        instance.own_pending_prefill_tokens = 0
        pending = set(waiting)
        while pending:  # as many go at once as the instance has room for; each that ends makes room
            gate.pump()
            done, pending = await asyncio.wait(pending, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            assert done
            for task in done:
                gate.leave(task.result())
        return seen

    async def main() -> None:
        first = await queue_and_drain([f"tenant-{n}" for n in range(120)])
        assert len(first) == FLOW_SERIES + 1 and first[OTHER_FLOWS] == 20
        assert all(first[f"tenant-{n}"] == 1 for n in range(FLOW_SERIES))
        assert _queued_by_flow(runtime) == {OTHER_FLOWS: 0}
        long_name = "agent-" + "x" * 300
        later = await queue_and_drain(["late-a", "late-a", "late-b", long_name])
        (cut,) = set(later) - {"late-a", "late-b", OTHER_FLOWS}
        assert later == {"late-a": 2, "late-b": 1, cut: 1, OTHER_FLOWS: 0}
        assert len(cut) == FLOW_LABEL_CHARS and cut.startswith("agent-xxx")

    asyncio.run(main())
