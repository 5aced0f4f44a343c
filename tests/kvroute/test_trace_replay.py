"""Trace replay: prompts that share hash ids share tokens, and requests go out on the trace's schedule."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvroute.processes import free_port_block
from kvroute.trace_replay import VOCABULARY, PromptSynth, ReplayPlan, replay_size, replay_trace, resolve_trace
from kvroute.traces import Trace, TraceRequest


def _request(
    arrival_s: float, block_ids: tuple[int, ...], input_tokens: int, session: str | None = None
) -> TraceRequest:
    return TraceRequest(arrival_s, input_tokens, output_tokens=100, block_ids=block_ids, session=session)


def test_shared_hash_ids_are_shared_tokens() -> None:
    synth = PromptSynth(seed=7, block_tokens=32, trace_block_tokens=512)
    first = synth.prompt(_request(0, (1, 2, 3), 3 * 512))
    second = synth.prompt(_request(0, (1, 2, 9, 10), 3 * 512 + 256))

    assert len(first) == 96 and len(second) == 3 * 32 + 16  # the last hash id cut in proportion
    assert first[:64] == second[:64] and first[64:96] != second[64:96]
    assert all(token in VOCABULARY for token in first + second)
    again = PromptSynth(seed=7, block_tokens=32, trace_block_tokens=512).prompt(
        _request(0, (1, 2, 3), 3 * 512)
    )
    other_seed = PromptSynth(seed=8, block_tokens=32, trace_block_tokens=512).prompt(
        _request(0, (1, 2, 3), 3 * 512)
    )
    assert again == first and other_seed[:32] != first[:32]


def test_every_hash_id_keeps_a_token() -> None:
    synth = PromptSynth(seed=0, block_tokens=16, trace_block_tokens=512)
    assert len(synth.prompt(_request(0, (1, 2), 513))) == 17  # 1 trace token of the last id: still 1 real one


def test_resolve_trace_takes_the_head_and_scales_the_rate(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 1000 * i, "input_length": 600, "output_length": 5, "hash_ids": [0, i]} for i in range(5)
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines))

    trace = resolve_trace(str(path), requests=3, rate=2.0)

    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="not agentic, programs, mooncake or a trace file"):
        resolve_trace(str(tmp_path / "missing.jsonl"))


class _Recorder:
    """A completions endpoint that answers after `delay_s` and records what it was sent, and when."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.received: list[tuple[float, dict[str, str], dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append((time.perf_counter(), dict(request.headers), await request.json()))
        await asyncio.sleep(self.delay_s)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
        await response.write(b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n')
        return response


def _assert_on_schedule(sent_at: list[float], schedule: list[float], late_s: float = 0.3) -> None:
    """Each request went out at its time, never before it; a loaded machine may make it up to `late_s` late.

    Times count from the first request's, so the replay's own start-up is not counted as lateness.
    """
    assert len(sent_at) == len(schedule)
    for sent, due in zip(sent_at, schedule, strict=True):
        assert due - 0.02 <= sent - sent_at[0] <= due + late_s, (sent_at, schedule)


async def _replay(recorder: _Recorder, plan: ReplayPlan) -> Any:
    app = web.Application()
    app.router.add_post("/v1/completions", recorder.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port_block(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        started = time.perf_counter()
        run = await replay_trace(f"http://127.0.0.1:{port}", plan)
        return started, run
    finally:
        await runner.cleanup()


def test_requests_go_out_on_schedule_whatever_the_answers_take() -> None:
    requests = (
        _request(10.0, (1, 2), 1024, "a"),
        _request(10.2, (1, 2, 3), 1500, "a"),
        _request(10.4, (5,) * 200, 512 * 200),  # 3,200 real tokens: over the limit, not sent
        _request(10.6, (1, 4), 1024),
        _request(99.0, (1, 4), 1024),  # past the time limit
    )
    plan = ReplayPlan(
        Trace("t", 512, requests),
        "m",
        seed=3,
        block_tokens=32,
        max_tokens=8,
        max_prompt_tokens=1000,
        time_limit_s=5,
        session_header="x-session",
    )
    recorder = _Recorder(delay_s=0.5)  # slower than the gaps between arrivals

    started, run = asyncio.run(_replay(recorder, plan))

    assert replay_size(plan) == 4
    assert run.not_sent == 1 and len(run.outcomes) == 3
    assert all(o.status == "ok" and o.ttft_s >= 0.5 and o.prompt_tokens == 3 for o in run.outcomes)
    sent_at = [at - started for at, _, _ in recorder.received]
    _assert_on_schedule(sent_at, [0.0, 0.2, 0.6])  # open loop: the third went before the first answer + 0.5
    bodies = [body for _, _, body in recorder.received]
    assert [len(b["prompt"]) for b in bodies] == [64, 94, 64]
    assert (
        bodies[1]["prompt"][:64] == bodies[0]["prompt"]
        and bodies[2]["prompt"][:32] == bodies[0]["prompt"][:32]
    )
    assert {b["max_tokens"] for b in bodies} == {8} and all(b["stream"] for b in bodies)
    sessions = [headers.get("x-session") for _, headers, _ in recorder.received]
    assert sessions[0] == sessions[1] == "trace-3-a" and sessions[2] is None


def test_a_turn_after_a_tool_call_goes_once_its_sessions_answer_came_and_the_tool_ran() -> None:
    requests = (
        _request(10.0, (1, 2), 1024, "a"),
        replace(_request(10.1, (1, 2, 3), 1500, "a"), tool_s=0.3),  # waits for the answer, then the tool
        replace(_request(10.2, (1, 2, 3, 4), 2000, "a"), tool_s=9.0),  # its tool ends past the time limit
        _request(10.2, (7, 8), 1024, "b"),
    )
    plan = ReplayPlan(Trace("t", 512, requests), "m", block_tokens=32, max_tokens=8, time_limit_s=3)
    recorder = _Recorder(delay_s=0.5)

    started, run = asyncio.run(_replay(recorder, plan))

    sent_at = [at - started for at, _, _ in recorder.received]
    _assert_on_schedule(sent_at, [0.0, 0.2, 0.8])  # b at its arrival; a's second after 0.5 + 0.3
    assert run.past_limit == 1 and len(run.outcomes) == 3
    second = max(run.outcomes, key=lambda o: o.ttft_s)
    assert 0.5 <= second.ttft_s <= 0.8  # from when it was sent (0.5), not from its arrival (1.2)
