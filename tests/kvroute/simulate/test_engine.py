"""The simulated engine schedules as vLLM V1's scheduler does: blocks as tokens need them, preemption of the
request admitted last, decode tokens in the step's budget, answers' full blocks cached."""

from __future__ import annotations

import pytest

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.engine import Engine, SimRequest
from kvroute.simulate.hardware import EngineSpec
from kvroute.traces import Trace, TraceRequest
from router.index.events import BlockStored, KVEvent


class _Engine:
    """One engine over a hand-made trace, its requests sent when told, its events kept."""

    def __init__(self, trace: Trace, spec: EngineSpec) -> None:
        self.blocks = TraceBlocks(trace, 16)
        self.loop = EventLoop()
        self.engine = Engine(0, spec, self.blocks, self.loop)
        self.events: list[KVEvent] = []
        self.engine.on_events = self.events.extend
        self.finished: list[int] = []
        self.engine.on_finish = lambda request: self.finished.append(request.number)
        self.requests: list[SimRequest] = []

    def send(self, *numbers: int) -> None:
        """Send them now and run until the engine is idle."""
        self.enqueue(*numbers)
        self.loop.run()

    def enqueue(self, *numbers: int) -> None:
        for number in numbers:
            traced = self.blocks.trace.requests[number]
            request = SimRequest(number, traced, self.blocks.chains[number], traced.session, self.loop.now)
            self.requests.append(request)
            assert self.engine.enqueue(request)

    def stored(self) -> list[int]:
        return [h for e in self.events if isinstance(e, BlockStored) for h in e.block_hashes]  # type: ignore[misc]


def _requests(*shapes: tuple[int, int, tuple[int, ...], str | None]) -> Trace:
    return Trace("engine", 32, tuple(TraceRequest(0.0, n, out, ids, s) for n, out, ids, s in shapes))


def test_a_decoding_request_takes_one_token_of_the_steps_budget_and_its_share_of_the_steps_time() -> None:
    """A decodes while B's 200-token prompt is prefilled 63 tokens a step (A's token is the 64th); each step
    costs its fixed part, A's share and B's tokens."""
    spec = EngineSpec(max_batched_tokens=64)
    engine = _Engine(_requests((32, 100, (1,), None), (200, 2, (2, 3, 4, 5, 6, 7, 8), None)), spec)
    engine.enqueue(0)
    engine.loop.at(spec.prefill_s(0, 32) + 0.001, lambda: engine.enqueue(1))  # A's first decode step runs
    engine.loop.run()
    second = engine.requests[1]
    chunks = [63, 63, 63, 11]
    steps = [spec.decode_step_s + spec.decode_step_s_per_seq + c / spec.prefill_tokens_per_s for c in chunks]
    # It waits for the end of A's step under way, then takes four steps with A.
    assert second.first_token_s - second.sent_s == pytest.approx(sum(steps), abs=spec.decode_step_s * 1.01)
    assert second.admitted_s > second.sent_s
    assert second.first_token_s - second.admitted_s == pytest.approx(sum(steps))


def test_when_blocks_run_out_the_request_admitted_last_is_preempted_and_computed_again() -> None:
    """Three requests whose answers outgrow 30 blocks together: vLLM takes the blocks back from the one it
    admitted last, sends it to the head of the queue, and computes its prompt and answer so far again once
    there is room; it finishes last."""
    ids = ((1, 2, 3), (4, 5, 6), (7, 8, 9))
    trace = _requests(*((80, 150, i, None) for i in ids))
    engine = _Engine(trace, EngineSpec(kv_blocks=30))
    engine.send(0, 1, 2)
    first, _, third = engine.requests
    assert engine.engine.preemptions >= 1
    assert first.preempted == 0 and third.preempted >= 1
    assert engine.finished[-1] == 2
    assert all(r.generated == 150 and r.finish_s > 0 for r in engine.requests)
    # Computed again: its prompt's blocks and its answer's, announced as the engine caches them.
    assert engine.stored().count(trace_chain(engine, 2)[0]) >= 1


def trace_chain(engine: _Engine, number: int) -> list[int]:
    return engine.blocks.chains[number].tolist()


def test_there_is_no_waiting_limit() -> None:
    trace = _requests(*((32, 4, (n,), None) for n in range(1, 201)))
    engine = _Engine(trace, EngineSpec(kv_blocks=40))
    engine.send(*range(200))
    assert len(engine.finished) == 200


def test_an_answers_full_blocks_are_cached_announced_and_hit_by_the_sessions_next_turn() -> None:
    """Turn 1 (64 prompt tokens, 30 answered) fills blocks 0-4; turn 2 resends them and more: it finds all
    five, where a prompt-only cache had held four."""
    trace = _requests((64, 30, (1, 2), "s"), (128, 2, (1, 2, 3, 4), "s"))
    engine = _Engine(trace, EngineSpec())
    engine.send(0)
    assert engine.stored() == trace_chain(engine, 1)[:5]
    engine.send(1)
    assert engine.requests[1].local_hit_blocks == 5


def test_without_a_session_an_answer_is_cached_under_tokens_no_later_prompt_has() -> None:
    trace = _requests((64, 30, (1, 2), None), (128, 2, (1, 2, 3, 4), None))
    engine = _Engine(trace, EngineSpec())
    engine.send(0)
    stored = engine.stored()
    assert len(stored) == 5 and stored[:4] == trace_chain(engine, 1)[:4]
    assert stored[4] not in trace_chain(engine, 1)
    engine.send(1)
    assert engine.requests[1].local_hit_blocks == 4
