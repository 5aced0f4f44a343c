"""Request traces for replay and simulation: the Mooncake JSONL format and a generated agentic workload.

A trace names each prompt by hash ids, one per `block_tokens` tokens (the last may be partial): two requests
share a prefix exactly as far as their leading hash ids agree. Times are seconds from the trace's start.
"""

from __future__ import annotations

import bisect
import itertools
import json
import lzma
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

# The public Mooncake conversation trace (FAST'25), shipped with the package: kvroute/data/README.md.
MOONCAKE_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.xz"


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    session: str | None = None
    flow: str | None = None  # the tenant it comes from (a fairness header); None: its session's
    objective: str | None = None  # the objective it names (router/dispatch/wait/settings.py)
    # The tool call before this turn: it is sent no sooner than this long after its session's previous
    # answer (None: as soon as that answer came, if its arrival has passed)
    tool_s: float | None = None
    # Where the prompt holds images: the hash ids a router that hashes token ids alone names it by. An image's
    # placeholder tokens are the same whatever the image, and vLLM folds the image into the keys of its
    # blocks, so these part from block_ids at the first image's block (None: block_ids, a text prompt)
    text_block_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Trace:
    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]

    @property
    def has_images(self) -> bool:
        """Whether any prompt has images (keys beyond its token ids, TraceRequest.text_block_ids)."""
        return any(r.text_block_ids is not None for r in self.requests)

    def with_rate(self, multiplier: float) -> Trace:
        """The same requests arriving `multiplier` times as fast (x2: twice the rate)."""
        if multiplier <= 0:
            raise ValueError(f"rate multiplier must be positive, not {multiplier}")
        requests = tuple(replace(r, arrival_s=r.arrival_s / multiplier) for r in self.requests)
        return replace(self, requests=requests)

    def head(self, count: int) -> Trace:
        return replace(self, requests=self.requests[:count])

    def skip(self, count: int) -> Trace:
        """Without its first `count` requests, arrivals counted from the first one left; the name says so."""
        if count < 0:
            raise ValueError(f"cannot skip {count} requests")
        if count == 0:
            return self
        requests = self.requests[count:]
        start = requests[0].arrival_s if requests else 0.0
        return replace(
            self,
            name=f"{self.name} after {count}",
            requests=tuple(replace(r, arrival_s=r.arrival_s - start) for r in requests),
        )

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


def load_trace(path: Path, block_tokens: int = 512, name: str | None = None) -> Trace:
    """A JSONL trace, plain or xz-compressed (`.xz`): one `{"timestamp" (ms), "input_length",
    "output_length", "hash_ids"}` per line. Unnamed, it is named after the file (`t.jsonl.xz`: `t`)."""
    requests: list[TraceRequest] = []
    compressed = path.suffix == ".xz"
    with lzma.open(path, "rt", encoding="utf-8") if compressed else path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                requests.append(_parse_line(line))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: malformed trace line: {exc}") from exc
    requests.sort(key=lambda r: r.arrival_s)
    start = requests[0].arrival_s if requests else 0.0
    requests = [replace(r, arrival_s=r.arrival_s - start) for r in requests]
    stem = Path(path.stem).stem if compressed else path.stem
    return Trace(name or stem, block_tokens, tuple(requests))


def _parse_line(line: str) -> TraceRequest:
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
        raise ValueError("hash_ids must be a list of integers")
    timestamp, input_length, output_length = (
        record["timestamp"],
        record["input_length"],
        record["output_length"],
    )
    if not isinstance(timestamp, int | float) or not math.isfinite(timestamp):
        raise ValueError("timestamp must be a number of milliseconds")
    if not isinstance(input_length, int) or input_length < 1:
        raise ValueError("input_length must be a positive integer")
    if not isinstance(output_length, int) or output_length < 0:
        raise ValueError("output_length must be a non-negative integer")
    session = record.get("session")
    return TraceRequest(
        timestamp / 1000.0, input_length, output_length, tuple(hash_ids), str(session) if session else None
    )


def agentic_trace(
    seed: int = 0,
    sessions: int = 120,
    block_tokens: int = 512,
    *,
    span_s: float = 1800.0,
    median_turns: int = 33,
    system_tokens: int = 4000,
    median_new_tokens: int = 1800,
    max_context_tokens: int = 180_000,
    input_output_ratio: float = 131.0,
    median_think_s: float = 8.0,
    max_think_s: float = 80.0,
    min_think_s: float = 1.0,
    think_sigma: float = 1.0,
    tool_calls: bool = False,
    images_every: int = 0,
    image_tokens: int = 1_000,
    name: str = "agentic",
) -> Trace:
    """Agent sessions that resend a growing context every turn.

    Every session starts with the same `system_tokens` (their full blocks share hash ids across sessions);
    each turn appends a few hundred to a few thousand tokens (tool output, the previous answer), so a turn's
    hash ids extend the previous turn's. Turns per session are log-normal around `median_turns`; contexts
    end near 80K tokens, none past `max_context_tokens`. Sessions start uniformly over `span_s`; the next
    turn arrives a think time (log-normal around `median_think_s` with `think_sigma`, within `min_think_s` ..
    `max_think_s` seconds) after the previous one. Output lengths are
    scaled so that prompt tokens : output tokens is `input_output_ratio` over the trace.

    With `tool_calls`, every turn after a session's first also runs a tool first (TraceRequest.tool_s): it
    comes no sooner than that after the previous answer, however early its think time had it. The tools'
    lengths follow the coding-agent trace published with vllm-router's program scheduling (86.5% of next
    requests within 1 s of the answer, 95.1% within 10 s): log-uniform over 0.05-1 s, 1-10 s and 10-300 s
    with those shares. They are drawn apart from the rest, so the sessions are the same as without.

    With `images_every` N, every Nth turn of a session ends with an image of `image_tokens` (a tool's
    screenshot; 1,000 is about a 1024x768 one: Qwen2-VL's 972, Anthropic's width x height / 750 = 1,049),
    which stays in the context after. Those requests carry text_block_ids too.
    """
    rng = random.Random(seed)
    tools = random.Random(f"tool-calls-{seed}")
    shared_blocks = system_tokens // block_tokens
    fresh_ids = itertools.count(shared_blocks)
    drafts: list[tuple[float, int, float, _TurnIds, str, float | None]] = []
    for number in range(sessions):
        session = f"s{seed}-{number}"
        turns = max(2, min(150, round(median_turns * math.exp(rng.gauss(0.0, 0.45)))))
        arrival = rng.uniform(0.0, span_s)
        context = system_tokens
        blocks = _SessionBlocks(shared_blocks, block_tokens, fresh_ids)
        for turn in range(turns):
            context += max(100, min(12_000, round(median_new_tokens * math.exp(rng.gauss(0.0, 0.7)))))
            if context > max_context_tokens:
                break
            if (
                images_every
                and (turn + 1) % images_every == 0
                and context + image_tokens <= max_context_tokens
            ):
                blocks.grow(context)
                blocks.add_image(context)
                context += image_tokens
            blocks.grow(context)
            tool_s = _tool_call_s(tools) if tool_calls and turn else None
            drafts.append((arrival, context, math.exp(rng.gauss(0.0, 0.6)), blocks.now(), session, tool_s))
            think = median_think_s * math.exp(rng.gauss(0.0, think_sigma))
            arrival += min(max_think_s, max(min_think_s, think))
    input_total = sum(d[1] for d in drafts)
    weight_total = sum(d[2] for d in drafts)
    scale = input_total / input_output_ratio / weight_total if weight_total else 0.0
    requests = sorted(
        (
            TraceRequest(
                a, context, max(1, round(w * scale)), ids.ids, session, tool_s=tool_s, text_block_ids=ids.text
            )
            for a, context, w, ids, session, tool_s in drafts
        ),
        key=lambda r: r.arrival_s,
    )
    return Trace(f"{name}-{seed}", block_tokens, tuple(requests))


class _SessionBlocks:
    """A session's hash ids as its context grows: the engine's, and from its first image on, those of a router
    that hashes token ids alone (the same until that image's block, fresh ids of their own after)."""

    def __init__(self, shared_blocks: int, block_tokens: int, fresh_ids: Iterator[int]) -> None:
        self.ids: list[int] = list(range(shared_blocks))
        self.text: list[int] | None = None
        self._block_tokens, self._fresh_ids = block_tokens, fresh_ids

    def grow(self, tokens: int) -> None:
        while len(self.ids) * self._block_tokens < tokens:
            self.ids.append(next(self._fresh_ids))
            if self.text is not None:
                self.text.append(next(self._fresh_ids))

    def add_image(self, at: int) -> None:
        """An image from token `at` on: the engine's ids of its block and after are new, the text's not."""
        first = at // self._block_tokens
        if self.text is None:
            self.text = list(self.ids)
        self.ids[first:] = [next(self._fresh_ids) for _ in self.ids[first:]]

    def now(self) -> _TurnIds:
        return _TurnIds(tuple(self.ids), tuple(self.text) if self.text is not None else None)


@dataclass(frozen=True)
class _TurnIds:
    ids: tuple[int, ...]
    text: tuple[int, ...] | None


# An agent's tool calls as published with vllm-router's program scheduling: (share, shortest, longest)
_TOOL_CALLS = ((0.865, 0.05, 1.0), (0.086, 1.0, 10.0), (0.049, 10.0, 300.0))


_TOOL_CALL_SHARES = list(itertools.accumulate(share for share, _, _ in _TOOL_CALLS))


def _tool_call_s(rng: random.Random) -> float:
    bucket = min(bisect.bisect(_TOOL_CALL_SHARES, rng.random()), len(_TOOL_CALLS) - 1)
    _, shortest, longest = _TOOL_CALLS[bucket]
    return float(shortest * (longest / shortest) ** rng.random())


def mooncake_trace() -> Trace:
    """The Mooncake conversation trace: 12,031 chat requests over an hour, 512-token blocks."""
    return load_trace(MOONCAKE_TRACE, name="mooncake-conversation")
