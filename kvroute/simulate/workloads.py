"""Seeded workload generators for the suite (`kvroute bench simulate --suite`), beside the agentic one in
kvroute/traces.py: a RAG service, bursty chat, long-context tool sessions and short chat with little reuse.

Each returns a `Trace` of the shape the simulator replays: hash ids per `block_tokens` tokens (the last
block may be partial), arrival times in seconds from the first, and a session name per conversation, whose
turns the simulator sends one after the other (closed loop). The same seed gives the same trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import replace

from kvroute.traces import Trace, TraceRequest

Segment = tuple[Hashable, int]  # (what the text is, its length in tokens)


class BlockNamer:
    """Hash ids for prompts made of named segments. A block gets the id of its content and everything before
    it, so two prompts share exactly the blocks their segments make identical, a partial last block
    included (it differs from a full one by its length). Ids count up from 0 in order of first use."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[int, tuple[tuple[Hashable, int, int], ...]], int] = {}

    def ids(self, segments: Sequence[Segment]) -> tuple[int, ...]:
        parts = [(key, length) for key, length in segments if length > 0]
        total = sum(length for _, length in parts)
        names: list[int] = []
        previous, part, offset = -1, 0, 0
        for start in range(0, total, self.block_tokens):
            need = min(self.block_tokens, total - start)
            content: list[tuple[Hashable, int, int]] = []
            while need:
                key, length = parts[part]
                take = min(length - offset, need)
                content.append((key, offset, take))
                need, offset = need - take, offset + take
                if offset == length:
                    part, offset = part + 1, 0
            previous = self._ids.setdefault((previous, tuple(content)), len(self._ids))
            names.append(previous)
        return tuple(names)


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, median * math.exp(rng.gauss(0.0, sigma))))


def _zipf_weights(count: int, exponent: float) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(count)]


def _trace(name: str, block_tokens: int, requests: list[TraceRequest]) -> Trace:
    requests.sort(key=lambda r: r.arrival_s)
    start = requests[0].arrival_s if requests else 0.0
    shifted = tuple(replace(r, arrival_s=r.arrival_s - start) for r in requests)
    return Trace(name, block_tokens, shifted)


def rag_trace(
    seed: int = 0,
    requests: int = 2000,
    block_tokens: int = 512,
    *,
    documents: int = 12,
    min_document_tokens: int = 8_000,
    max_document_tokens: int = 32_000,
    popularity_exponent: float = 1.0,
    system_tokens: int = 600,
    median_question_tokens: int = 120,
    median_output_tokens: int = 250,
    rate_rps: float = 4.0,
) -> Trace:
    """A retrieval-augmented QA service: a few long shared documents, many short questions over them.

    Every prompt is the same `system_tokens` instructions, one of `documents` documents (log-uniform between
    `min_document_tokens` and `max_document_tokens`; picked by Zipf popularity with `popularity_exponent`,
    so a handful are hot) and a fresh question (log-normal around `median_question_tokens`, 20-1,000).
    Questions arrive as a Poisson process at `rate_rps`, each from its own user (a session of one turn),
    answers log-normal around `median_output_tokens`. Stands for a support bot or document assistant over a
    fixed corpus: nearly every prompt token (96% of the first 500 requests) is a document an earlier request
    already sent, and the router's job is to keep each hot document cached somewhere without piling its
    questions onto one instance.
    """
    rng = random.Random(seed)
    namer = BlockNamer(block_tokens)
    ratio = max_document_tokens / min_document_tokens
    lengths = [round(min_document_tokens * ratio ** rng.random()) for _ in range(documents)]
    weights = _zipf_weights(documents, popularity_exponent)
    drafts: list[TraceRequest] = []
    arrival = 0.0
    for number in range(requests):
        document = rng.choices(range(documents), weights)[0]
        question = round(_lognormal(rng, median_question_tokens, 0.6, 20, 1000))
        segments = [
            ("system", system_tokens),
            (("document", document), lengths[document]),
            (("question", number), question),
        ]
        output = max(1, round(_lognormal(rng, median_output_tokens, 0.6, 10, 2000)))
        tokens = sum(length for _, length in segments)
        drafts.append(TraceRequest(arrival, tokens, output, namer.ids(segments), f"rag{seed}-q{number}"))
        arrival += rng.expovariate(rate_rps)
    return _trace(f"rag-{seed}", block_tokens, drafts)


def on_off_arrivals(
    rng: random.Random, count: int, on_s: float, off_s: float, on_rate_rps: float, off_rate_rps: float
) -> list[float]:
    """count arrival times from an on/off source: Poisson at on_rate_rps for an on period, then at
    off_rate_rps for an off period, and again; each period lasts 0.5-1.5 times its mean."""
    times: list[float] = []
    start, on = 0.0, True
    while len(times) < count:
        length = (on_s if on else off_s) * rng.uniform(0.5, 1.5)
        rate = on_rate_rps if on else off_rate_rps
        clock = start
        while rate > 0 and len(times) < count:
            clock += rng.expovariate(rate)
            if clock >= start + length:
                break
            times.append(clock)
        start, on = start + length, not on
    return times


def bursty_trace(
    seed: int = 0,
    requests: int = 2000,
    block_tokens: int = 512,
    *,
    on_s: float = 10.0,
    off_s: float = 20.0,
    on_rate_rps: float = 10.0,
    off_rate_rps: float = 0.0,
    system_prompts: int = 4,
    system_tokens: int = 2_000,
    follow_up_share: float = 0.5,
    median_message_tokens: int = 400,
    median_output_tokens: int = 300,
) -> Trace:
    """Chat traffic that comes in bursts: arrivals from an on/off source (`on_off_arrivals`), Poisson at
    `on_rate_rps` during on periods of about `on_s` seconds and at `off_rate_rps` (none by default) during
    off periods of about `off_s`. Each arrival is, with probability `follow_up_share`, the next turn of a
    conversation already open (chosen uniformly; it resends the conversation's history, its last answer and
    a new message), else a new conversation on one of `system_prompts` system prompts of `system_tokens`.
    Messages are log-normal around `median_message_tokens`, answers around `median_output_tokens`. Stands
    for a chat or API service hit by spikes (a batch job, a launch, the start of a working day) between
    quiet spells: queues build within a burst, and the off periods let them drain.
    """
    rng = random.Random(seed)
    namer = BlockNamer(block_tokens)
    times = on_off_arrivals(rng, requests, on_s, off_s, on_rate_rps, off_rate_rps)
    histories: list[list[Segment]] = []
    drafts: list[TraceRequest] = []
    for number, arrival in enumerate(times):
        if histories and rng.random() < follow_up_share:
            conversation = rng.randrange(len(histories))
        else:
            conversation = len(histories)
            histories.append([(("system", rng.randrange(system_prompts)), system_tokens)])
        history = histories[conversation]
        history.append((("message", number), round(_lognormal(rng, median_message_tokens, 0.8, 10, 8000))))
        output = max(1, round(_lognormal(rng, median_output_tokens, 0.6, 10, 2000)))
        tokens = sum(length for _, length in history)
        name = f"bursty{seed}-c{conversation}"
        drafts.append(TraceRequest(arrival, tokens, output, namer.ids(history), name))
        history.append((("answer", number), output))
    return _trace(f"bursty-{seed}", block_tokens, drafts)


def long_context_trace(
    seed: int = 0,
    sessions: int = 48,
    block_tokens: int = 512,
    *,
    span_s: float = 1200.0,
    system_tokens: int = 6_000,
    min_initial_tokens: int = 15_000,
    max_initial_tokens: int = 40_000,
    min_session_tokens: int = 50_000,
    max_session_tokens: int = 150_000,
    median_step_tokens: int = 6_000,
    median_output_tokens: int = 300,
    median_think_s: float = 6.0,
) -> Trace:
    """Tool-using agents over long contexts: every session ends with 50K-150K tokens of context.

    A session starts with the shared `system_tokens` (instructions and tool definitions) and a large first
    load (a repository, a document set: uniform in `min_initial_tokens` .. `max_initial_tokens`), then each
    turn appends a tool result (log-normal around `median_step_tokens`, 500-30,000) until the session
    reaches its own length, uniform in `min_session_tokens` .. `max_session_tokens` (its last turn ends
    there exactly). Sessions start uniformly over `span_s`; the next turn comes a tool run after the
    previous one's arrival (log-normal around `median_think_s`, 1-60 s), and the simulator sends it no
    earlier than the previous answer. Answers are short tool calls, log-normal around
    `median_output_tokens`. Stands for coding and research agents: few sessions, each holding a large
    share of one instance's KV memory (400K tokens in the reference setup), so where a session lives and
    what gets evicted dominate.
    """
    rng = random.Random(seed)
    namer = BlockNamer(block_tokens)
    drafts: list[TraceRequest] = []
    for number in range(sessions):
        name = f"long{seed}-s{number}"
        target = rng.randint(min_session_tokens, max_session_tokens)
        initial = rng.randint(min_initial_tokens, max_initial_tokens)
        context: list[Segment] = [("system", system_tokens), ((name, "load"), initial)]
        tokens = system_tokens + initial
        arrival = rng.uniform(0.0, span_s)
        turn = 0
        while True:
            output = max(1, round(_lognormal(rng, median_output_tokens, 0.6, 20, 2000)))
            drafts.append(TraceRequest(arrival, tokens, output, namer.ids(context), name))
            left = target - tokens
            if left <= 0:
                break
            call = min(output, left)  # the answer, resent; cut where the session ends
            step = min(round(_lognormal(rng, median_step_tokens, 0.8, 500, 30_000)), left - call)
            context += [((name, "call", turn), call), ((name, "result", turn), step)]
            tokens += call + step
            turn += 1
            arrival += _lognormal(rng, median_think_s, 0.8, 1.0, 60.0)
    return _trace(f"long-context-{seed}", block_tokens, drafts)


def chat_trace(
    seed: int = 0,
    requests: int = 2000,
    block_tokens: int = 512,
    *,
    system_prompts: int = 3_000,
    min_system_tokens: int = 50,
    max_system_tokens: int = 1_200,
    follow_up_share: float = 0.25,
    median_message_tokens: int = 150,
    median_output_tokens: int = 250,
    median_think_s: float = 20.0,
    rate_rps: float = 6.0,
) -> Trace:
    """Short chat with little reuse: many conversations of a turn or a few, short prompts.

    Conversations start as a Poisson process at `rate_rps`; each uses one of `system_prompts` system prompts
    (uniformly, so each is shared by few conversations; lengths uniform in `min_system_tokens` ..
    `max_system_tokens`); after each turn it goes on with probability `follow_up_share` (at most 8
    turns). A turn resends the history and adds a message (log-normal around `median_message_tokens`,
    5-2,000); the next turn comes a think time after (log-normal around `median_think_s`, 2-120 s).
    Answers are log-normal around `median_output_tokens`. Stands for a consumer chat app or many small API
    tenants: most prompts fit in a block or two and share little (a follow-up's history is the only
    reuse), so the cache barely helps and balancing the load is the whole job. Generates `requests`
    turns.
    """
    rng = random.Random(seed)
    namer = BlockNamer(block_tokens)
    prompts = [rng.randint(min_system_tokens, max_system_tokens) for _ in range(system_prompts)]
    drafts: list[TraceRequest] = []
    start, conversation = 0.0, 0
    while len(drafts) < requests:
        start += rng.expovariate(rate_rps)
        system = rng.randrange(system_prompts)
        history: list[Segment] = [(("system", system), prompts[system])]
        name = f"chat{seed}-c{conversation}"
        arrival, turn = start, 0
        while turn == 0 or (turn < 8 and rng.random() < follow_up_share):
            message = round(_lognormal(rng, median_message_tokens, 0.9, 5, 2000))
            history.append(((name, "message", turn), message))
            output = max(1, round(_lognormal(rng, median_output_tokens, 0.7, 5, 2000)))
            tokens = sum(length for _, length in history)
            drafts.append(TraceRequest(arrival, tokens, output, namer.ids(history), name))
            history.append(((name, "answer", turn), output))
            arrival += _lognormal(rng, median_think_s, 0.8, 2.0, 120.0)
            turn += 1
        conversation += 1
    drafts.sort(key=lambda r: r.arrival_s)
    return _trace(f"chat-{seed}", block_tokens, drafts[:requests])


def tenants_trace(
    seed: int = 0,
    requests: int = 2000,
    block_tokens: int = 512,
    *,
    sessions_rps: float = 0.2,
    turns: int = 12,
    tools_tokens: int = 3_000,
    median_turn_tokens: int = 300,
    median_think_s: float = 3.0,
    batch_share: float = 0.8,
    min_batch_tokens: int = 6_000,
    max_batch_tokens: int = 24_000,
) -> Trace:
    """Two tenants on one fleet: flow `interactive`, agent sessions of short turns (each resends a context
    that grows by a tool result and an answer, log-normal around `median_turn_tokens`, after a think time
    around `median_think_s`), and flow `batch`, one-shot long prompts (log-uniform between
    `min_batch_tokens` and `max_batch_tokens`, nothing shared but a 1,000-token instruction) arriving as a
    Poisson process at 4x the interactive turns' rate (`batch_share` of all requests). Each flow names an
    objective of its own name (kvroute/simulate/policies.py configures `interactive` at priority 10 and
    `batch` at -10). Stands for a coding assistant's users beside an offline job on the same instances: the
    batch flood must not push the sessions' short turns back.
    """
    rng = random.Random(seed)
    namer = BlockNamer(block_tokens)
    drafts: list[TraceRequest] = []
    interactive = round(requests * (1 - batch_share))
    start, session = 0.0, 0
    while sum(r.flow == "interactive" for r in drafts) < interactive:
        start += rng.expovariate(sessions_rps)
        name = f"tenant{seed}-s{session}"
        history: list[Segment] = [("tools", tools_tokens), ((name, "task"), 400)]
        arrival = start
        for turn in range(turns):
            tokens = sum(length for _, length in history)
            output = max(1, round(_lognormal(rng, 80, 0.6, 5, 600)))
            drafts.append(
                TraceRequest(arrival, tokens, output, namer.ids(history), name, "interactive", "interactive")
            )
            history += [((name, "answer", turn), output)]
            history += [((name, "result", turn), round(_lognormal(rng, median_turn_tokens, 0.7, 20, 4000)))]
            arrival += _lognormal(rng, median_think_s, 0.6, 0.5, 30.0)
        session += 1
    drafts = sorted(drafts, key=lambda r: r.arrival_s)[:interactive]
    span = drafts[-1].arrival_s if drafts else 1.0
    ratio = max_batch_tokens / min_batch_tokens
    arrival = 0.0
    for number in range(requests - interactive):
        arrival += rng.expovariate((requests - interactive) / span)
        document = round(min_batch_tokens * ratio ** rng.random())
        segments: list[Segment] = [("batch-instructions", 1_000), (("batch", number), document)]
        output = max(1, round(_lognormal(rng, 200, 0.6, 10, 1000)))
        ids = namer.ids(segments)
        drafts.append(
            TraceRequest(arrival, 1_000 + document, output, ids, f"batch{seed}-{number}", "batch", "batch")
        )
    return _trace(f"tenants-{seed}", block_tokens, drafts)


def skewed_flows_trace(
    seed: int = 0,
    requests: int = 2000,
    block_tokens: int = 512,
    *,
    heavy_share: float = 0.8,
    median_prompt_tokens: int = 3_000,
    rate_rps: float = 10.0,
) -> Trace:
    """Two tenants of equal priority sending the same kind of request, one (`heavy`) four times as many as
    the other (`light`): one-shot prompts (a shared 500-token instruction and a log-normal body around
    `median_prompt_tokens`), Poisson at `rate_rps` together. While both have requests waiting, a fair
    router dispatches them about equally (issue: each at least 45%), whatever their arrival rates.
    """
    rng = random.Random(seed)
    namer = BlockNamer(block_tokens)
    drafts: list[TraceRequest] = []
    arrival = 0.0
    for number in range(requests):
        arrival += rng.expovariate(rate_rps)
        flow = "heavy" if rng.random() < heavy_share else "light"
        body = round(_lognormal(rng, median_prompt_tokens, 0.6, 100, 16_000))
        segments: list[Segment] = [("instructions", 500), ((flow, number), body)]
        output = max(1, round(_lognormal(rng, 150, 0.6, 10, 1000)))
        ids = namer.ids(segments)
        drafts.append(TraceRequest(arrival, 500 + body, output, ids, f"{flow}{seed}-{number}", flow=flow))
    return _trace(f"flows-{seed}", block_tokens, drafts)
