"""The long-prompt case of ``kvroute bench overhead``: agent turns of 10K-100K tokens, where the routing
decision needs the prompt's token ids. kvroute tokenizes locally and keeps conversation prefixes cached;
vllm-router's kv_aware asks the workers to render the prompt. The backend answers at once but tokenizes for
/tokenize and render as a vLLM server would, so what each router adds over the backend alone is its decision
plus proxying.

Each target replays its own session (its own text, so no cache sees another's), turns interleaved across
targets: turn 1 is the whole prompt, later turns append a tool output of about 300 tokens. Before the first,
each target answers one conversation of its own that is not measured, so that turn 1 is a new conversation
on a running router, not the router's first long prompt (which pays once for what it sets up on first use:
kvroute's first render compiles the chat template, about 10 ms with the tokenizer's first call).
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvroute.bench.overhead.targets import DIRECT, Running

_WORDS = (
    "router cache prefix token block engine worker request session agent tool output index event score "
    "latency throughput queue model prompt decode prefill batch memory pool instance policy weight load "
    "the a of to and in is for on with as by at from that this it be are was were will can must not"
).split()
_TURN_WORDS = 250
_WARM_UP_WORDS = 2000  # a conversation of a few thousand tokens, shorter than any measured one
_TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class LongResult:
    target: str
    tokens: int  # the size asked for
    turn: int
    latency_ms: float | None = None
    added_ms: float | None = None  # over direct, same size and turn
    status: int = 0
    prompt_blocks: int | None = None  # kvroute's x-kvroute-prompt-blocks: it did tokenize
    error: str = ""


@dataclass
class LongSummary:
    target: str
    tokens: int
    first_turn_ms: float | None
    later_turns_ms: float | None  # median over turns 2..n
    first_turn_added_ms: float | None
    later_turns_added_ms: float | None


class _Session:
    def __init__(self, seed: str, words: int) -> None:
        self._rng = random.Random(seed)
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"You are agent {seed}."},
            {"role": "user", "content": self._text(words)},
        ]

    def _text(self, words: int) -> str:
        return " ".join(self._rng.choices(_WORDS, k=words))

    def next_turn(self) -> None:
        self.messages.append({"role": "assistant", "content": "ok"})
        self.messages.append({"role": "user", "content": "tool output: " + self._text(_TURN_WORDS)})

    def body(self) -> bytes:
        return msgspec.json.encode({"model": "tiny-llama", "max_tokens": 1, "messages": self.messages})


async def tokens_per_word(session: aiohttp.ClientSession, backend_url: str) -> float:
    sample = _Session("calibrate", 2000).messages[1:]
    body = {"model": "tiny-llama", "messages": sample, "add_generation_prompt": False}
    async with session.post(backend_url + "/tokenize", json=body, timeout=_TIMEOUT) as response:
        count = int((await response.json())["count"])
    return count / 2000


async def run_long(
    runs: Sequence[Running],
    sizes: Sequence[int],
    turns: int,
    on_result: Callable[[LongResult], None],
) -> list[LongResult]:
    active = [r for r in runs if not r.skipped]
    direct = next(r for r in active if r.target.kind == DIRECT)
    results: list[LongResult] = []
    connector = aiohttp.TCPConnector(limit_per_host=1)
    async with aiohttp.ClientSession(connector=connector) as client:
        per_word = await tokens_per_word(client, direct.url)
        await _warm_up(client, active)
        for size in sizes:
            words = max(int(size / per_word), 1)
            sessions = {r.target.label: _Session(uuid.uuid4().hex[:12], words) for r in active}
            for turn in range(turns):
                rotation = turn % len(active)
                turn_results = []
                for run in [*active[rotation:], *active[:rotation]]:
                    session = sessions[run.target.label]
                    result = await _post(client, run, session.body(), size, turn)
                    session.next_turn()
                    turn_results.append(result)
                    on_result(result)
                _compare(turn_results)
                results.extend(turn_results)
    return results


async def _warm_up(client: aiohttp.ClientSession, active: Sequence[Running]) -> None:
    """One unmeasured conversation of its own to each target (module docstring); its outcome is not kept."""
    for run in active:
        await _post(client, run, _Session(f"warm-up-{uuid.uuid4().hex[:12]}", _WARM_UP_WORDS).body(), 0, 0)


async def _post(client: aiohttp.ClientSession, run: Running, body: bytes, size: int, turn: int) -> LongResult:
    result = LongResult(run.target.label, size, turn)
    headers = {"Content-Type": "application/json"}
    started = time.perf_counter()
    try:
        async with client.post(
            run.url + "/v1/chat/completions", data=body, headers=headers, timeout=_TIMEOUT
        ) as response:
            await response.read()
            result.status = response.status
            blocks = response.headers.get("x-kvroute-prompt-blocks")
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = repr(exc)
        return result
    result.latency_ms = (time.perf_counter() - started) * 1000
    result.prompt_blocks = int(blocks) if blocks is not None else None
    if result.status != 200:
        result.error = f"HTTP {result.status}"
    return result


def _compare(turn_results: Sequence[LongResult]) -> None:
    direct = next((r for r in turn_results if r.target == DIRECT and r.latency_ms is not None), None)
    if direct is None or direct.latency_ms is None:
        return
    for result in turn_results:
        if result is not direct and result.latency_ms is not None and not result.error:
            result.added_ms = result.latency_ms - direct.latency_ms


def summarize(results: Sequence[LongResult]) -> list[LongSummary]:
    keys = list(dict.fromkeys((r.target, r.tokens) for r in results))
    summaries = []
    for target, tokens in keys:
        rows = [r for r in results if (r.target, r.tokens) == (target, tokens) and not r.error]
        first = [r for r in rows if r.turn == 0]
        later = [r for r in rows if r.turn > 0]
        summaries.append(
            LongSummary(
                target,
                tokens,
                _median([r.latency_ms for r in first]),
                _median([r.latency_ms for r in later]),
                _median([r.added_ms for r in first]),
                _median([r.added_ms for r in later]),
            )
        )
    return summaries


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def vllm_router_counters(metrics_url: str) -> dict[str, float]:
    """vllm-router's own account of how it got token ids (render, tokenize) and what its index found."""
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm_router_kv_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                counters[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return counters
