from __future__ import annotations

import math
import random
from collections.abc import Callable
from itertools import pairwise

import pytest

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.workloads import (
    BlockNamer,
    bursty_trace,
    chat_trace,
    long_context_trace,
    on_off_arrivals,
    rag_trace,
)
from kvroute.traces import Trace

GENERATORS: dict[str, Callable[[int], Trace]] = {
    "rag": lambda seed: rag_trace(seed, 300),
    "bursty": lambda seed: bursty_trace(seed, 300),
    "long-context": lambda seed: long_context_trace(seed, 12),
    "chat": lambda seed: chat_trace(seed, 300),
}


def test_block_namer_shares_exactly_what_the_segments_make_identical() -> None:
    namer = BlockNamer(4)
    first = namer.ids([("system", 6), ("a", 5)])
    second = namer.ids([("system", 6), ("b", 5)])
    assert len(first) == math.ceil(11 / 4) == len(second)
    assert first[0] == second[0]  # the system prompt's full block
    assert first[1:] != second[1:] and not set(first[1:]) & set(second[1:])
    assert namer.ids([("system", 6), ("a", 5)]) == first  # the same prompt, the same ids
    assert namer.ids([("system", 6), ("a", 6)])[:2] == first[:2]  # a longer prompt extends it
    assert namer.ids([("system", 6)])[1] != first[1]  # a partial block differs from the full one
    assert namer.ids([("system", 2), ("system", 4)]) != namer.ids([("system", 6)])[:2]


@pytest.mark.parametrize("name", GENERATORS)
def test_generators_are_deterministic_and_give_the_simulators_trace_shape(name: str) -> None:
    trace = GENERATORS[name](0)
    assert trace == GENERATORS[name](0)
    assert trace != GENERATORS[name](1)
    requests = trace.requests
    assert requests[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in pairwise(requests))
    last_of: dict[str, tuple[int, ...]] = {}
    for request in requests:
        assert len(request.block_ids) == math.ceil(request.input_tokens / trace.block_tokens)
        assert request.output_tokens >= 1 and request.session is not None
        before = last_of.get(request.session)
        if before is not None:  # a session's turn resends the previous one: its full blocks lead
            assert request.block_ids[: len(before) - 1] == before[:-1]
        last_of[request.session] = request.block_ids
    TraceBlocks(trace)  # the simulator hashes it


def test_rag_questions_reuse_the_shared_documents() -> None:
    trace = rag_trace(0, 400)
    assert TraceBlocks(trace).ideal_hit_rate() > 0.9
    assert len({r.session for r in trace.requests}) == 400  # every question its own user
    assert all(8_000 < r.input_tokens < 34_000 for r in trace.requests)
    shared = {r.block_ids[1] for r in trace.requests}  # the block after the system prompt's: the document
    assert 1 < len(shared) <= 12


def test_long_context_sessions_end_between_50k_and_150k_tokens() -> None:
    trace = long_context_trace(3, 30)
    sessions: dict[str, list[int]] = {}
    for request in trace.requests:
        sessions.setdefault(request.session or "", []).append(request.input_tokens)
    assert len(sessions) == 30
    for lengths in sessions.values():
        assert lengths == sorted(lengths) and len(lengths) >= 2
        assert lengths[0] < 50_000 and 50_000 <= lengths[-1] <= 150_000


def test_bursty_arrivals_come_in_on_periods_with_quiet_off_periods() -> None:
    times = on_off_arrivals(random.Random(5), 1000, on_s=10.0, off_s=20.0, on_rate_rps=10.0, off_rate_rps=0.0)
    assert len(times) == 1000 and times == sorted(times)
    gaps = [b - a for a, b in pairwise(times)]
    quiet = [gap for gap in gaps if gap >= 10.0]  # an off period lasts at least half its mean
    assert 7 <= len(quiet) <= 13  # ~100 arrivals a burst
    assert max(gap for gap in gaps if gap < 10.0) < 3.0  # within a burst: Poisson at 10/s
    trace = bursty_trace(0, 500)
    trace_gaps = [b.arrival_s - a.arrival_s for a, b in pairwise(trace.requests)]
    assert sum(gap >= 10.0 for gap in trace_gaps) >= 3


def test_short_chat_reuses_little() -> None:
    trace = chat_trace(0, 500)
    assert TraceBlocks(trace).ideal_hit_rate() < 0.35
    assert sum(r.input_tokens for r in trace.requests) / len(trace.requests) < 2_000
    assert len({r.session for r in trace.requests}) > 300
