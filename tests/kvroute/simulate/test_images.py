"""Prompts with images in the simulator: the engine keys an image's blocks by the image, a router that hashes
token ids alone (vllm-router, SGLang's gateway) does not, and kvroute keys them as the engine does."""

from __future__ import annotations

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.engine import SimRequest
from kvroute.simulate.hardware import EngineSpec, FleetSpec
from kvroute.simulate.peers import VllmRouterKvAware
from kvroute.simulate.simulation import simulate
from kvroute.traces import Trace, TraceRequest, agentic_trace


def test_an_image_parts_the_text_ids_from_the_engines_at_its_block_and_stays_in_the_context() -> None:
    trace = agentic_trace(seed=2, sessions=6, images_every=3)
    last: dict[str, TraceRequest] = {}
    imaged = 0
    for request in trace.requests:
        assert request.session is not None
        previous = last.get(request.session)
        text = request.text_block_ids
        if text is not None:
            imaged += 1
            assert len(text) == len(request.block_ids)
            parted = next(i for i, (a, b) in enumerate(zip(text, request.block_ids, strict=True)) if a != b)
            assert parted >= 7  # the shared system prompt's 7 blocks come first
            assert request.block_ids[:parted] == text[:parted]
        if previous is not None:  # each naming extends the turn before: the image stays where it was
            assert request.block_ids[: len(previous.block_ids)] == previous.block_ids
            if previous.text_block_ids is not None:
                assert text is not None and text[: len(previous.text_block_ids)] == previous.text_block_ids
        last[request.session] = request
    assert imaged and imaged < len(trace.requests)
    plain = agentic_trace(seed=2, sessions=6)
    assert all(r.text_block_ids is None for r in plain.requests)
    assert sum(r.input_tokens for r in trace.requests) > sum(r.input_tokens for r in plain.requests)


def test_text_chains_equal_the_engines_up_to_the_image() -> None:
    turns = (
        TraceRequest(0.0, 100, 2, (1, 2, 3, 4), "s", text_block_ids=(1, 2, 5, 6)),  # an image from block 2
        TraceRequest(1.0, 40, 2, (1, 9), "t"),
    )
    blocks = TraceBlocks(Trace("hand", 32, turns), 16)
    text, engine = blocks.text_chain(0), blocks.chains[0]
    assert text is not None and len(text) == len(engine) == 6
    assert text[:4] == engine[:4] and all(a != b for a, b in zip(text[4:], engine[4:], strict=True))
    assert blocks.text_chain(1) is None


class _KvAwareEstimates(VllmRouterKvAware):
    def __init__(self) -> None:
        self.new_tokens: list[int] = []

    def route(self, request: SimRequest) -> int:
        self.new_tokens.append(self.new_prefill_tokens(request)[0])
        return super().route(request)


def test_vllm_router_predicts_no_hit_past_an_image_the_engine_hits() -> None:
    """A session's second turn at the instance that holds its first turn, image included: vllm-router's
    prompt hashes match the engine's events only before the image, so it counts the rest as new."""
    first, second = (1, 2, 3, 4), (1, 2, 3, 4, 7)
    with_image = (
        TraceRequest(0.0, 100, 2, first, "s", text_block_ids=(1, 2, 5, 6)),
        TraceRequest(1.0, 130, 2, second, "s", text_block_ids=(1, 2, 5, 6, 8)),
    )
    fleet = FleetSpec(1, EngineSpec(kv_blocks=400, max_waiting=8), None, event_delay_s=0.01)
    estimates: dict[str, list[int]] = {}
    hit_rates: dict[str, float] = {}
    for name, turns in (
        ("image", with_image),
        ("text", (TraceRequest(0.0, 100, 2, first, "s"), TraceRequest(1.0, 130, 2, second, "s"))),
    ):
        policy = _KvAwareEstimates()
        result = simulate(TraceBlocks(Trace(name, 32, turns), 16), fleet, policy, ideal_hit_rate=0.0)
        assert result.completed == 2
        estimates[name], hit_rates[name] = policy.new_tokens, result.local_hit_rate
    assert estimates["image"][1] == 130 - 4 * 16  # the two blocks before the image
    assert estimates["text"][1] <= 130 - 6 * 16
    assert hit_rates["image"] == hit_rates["text"] > 0  # the engine hits the same either way
