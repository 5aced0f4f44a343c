"""The peers' shipped queues as variants: Dynamo's router queue and llm-d's flow control hold requests by
their own rules."""

from __future__ import annotations

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.hardware import EngineSpec, FleetSpec
from kvroute.simulate.registry import POLICIES
from kvroute.simulate.run import Run
from kvroute.traces import Trace, TraceRequest


def _run(policy: str, spec: EngineSpec, *requests: TraceRequest) -> Run:
    blocks = TraceBlocks(Trace("queues", 32, requests), 16)
    fleet = FleetSpec(1, spec, None, event_delay_s=0.01)
    run = Run(blocks, fleet, POLICIES[policy](fleet))
    run.run(ideal_hit_rate=0.0)
    return run


def test_dynamos_queue_holds_a_request_while_every_worker_has_more_prefill_than_its_threshold() -> None:
    """Busy past 4 x 64 active prefill tokens: the second prompt waits in the router for the first's first
    token; Dynamo without its queue sends it on at once."""
    spec = EngineSpec(max_batched_tokens=64)
    requests = (TraceRequest(0.0, 320, 4, tuple(range(1, 11))), TraceRequest(0.001, 64, 4, (20, 21)))
    for name in ("dynamo+queue-fcfs", "dynamo+queue-wspt"):
        first, second = sorted(_run(name, spec, *requests).done, key=lambda r: r.number)
        assert second.queued_s > 0
        assert second.admitted_s >= first.first_token_s
    _, second = sorted(_run("dynamo", spec, *requests).done, key=lambda r: r.number)
    assert second.queued_s == 0  # it waits in the engine instead


def test_llmds_flow_control_holds_requests_while_the_scraped_kv_usage_is_past_its_threshold() -> None:
    """The first request fills 28 of 30 blocks (93%): the second waits for a scrape after it ended."""
    spec = EngineSpec(kv_blocks=30)
    requests = (TraceRequest(0.0, 440, 8, tuple(range(1, 15))), TraceRequest(0.1, 32, 4, (20,)))
    first, second = sorted(_run("llm-d+flow-control", spec, *requests).done, key=lambda r: r.number)
    assert second.queued_s > 0 and second.admitted_s >= first.finish_s
    first, second = sorted(_run("llm-d", spec, *requests).done, key=lambda r: r.number)
    assert second.queued_s == 0
