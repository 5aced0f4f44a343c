"""Requests that measure one running vLLM instance: a prompt's time to first token by its length, a decode
step's length by the batch, its KV cache and its preemptions (its /metrics).

Every probe's prompt is fresh token ids, so no prefix is cached, unless it is sent again on purpose; the
instance serves nothing else meanwhile.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvroute.agent_sessions import TurnOutcome, post_stream
from kvroute.trace_replay import VOCABULARY
from router.upstreams.load_scraper import cache_configs, metric_samples, parse_pool_load_rate


class ProbeFailed(RuntimeError):
    """The engine did not answer a probe."""


@dataclass(frozen=True)
class Streamed:
    ttft_s: float
    last_token_s: float  # from the send to the last token


class Engine:
    """One vLLM instance's OpenAI API, probed with token-id prompts."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, seed: int = 0) -> None:
        self._http, self._url, self._model = http, url.rstrip("/"), model
        self._rng = random.Random(seed)

    def fresh_prompt(self, tokens: int) -> list[int]:
        return [self._rng.choice(VOCABULARY) for _ in range(tokens)]

    async def stream(self, prompt: Sequence[int], max_tokens: int) -> Streamed:
        """One completion of exactly max_tokens tokens, streamed: when its first and last tokens came. (The
        server may send several tokens in one chunk: a chunk's arrival says nothing of one token's.)"""
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        arrivals: list[float] = []
        started = time.perf_counter()

        def on_chunk(chunk: dict[str, Any]) -> None:
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                arrivals.append(time.perf_counter())

        outcome = await post_stream(self._http, f"{self._url}/v1/completions", body, {}, on_chunk)
        if isinstance(outcome, TurnOutcome) or not arrivals:
            error = outcome.error if isinstance(outcome, TurnOutcome) else "no token"
            raise ProbeFailed(f"{self._url}: {error}")
        return Streamed(arrivals[0] - started, arrivals[-1] - started)

    async def metrics(self) -> str:
        async with self._http.get(f"{self._url}/metrics") as response:
            response.raise_for_status()
            return await response.text()

    async def cache(self) -> tuple[int, int]:
        """Its KV cache: blocks and tokens a block."""
        configs = cache_configs((await self.metrics()).encode(), None)
        if not configs:
            raise ProbeFailed(f"{self._url}/metrics has no vllm:cache_config_info with its blocks")
        return configs[0]

    async def preemptions(self) -> int:
        return int(counter(await self.metrics(), "vllm:num_preemptions_total"))

    async def pool_load_rate(self) -> float | None:
        """Seconds a token its pool loads took, as the router reads it (None: too few loads to tell)."""
        return parse_pool_load_rate((await self.metrics()).encode())


def counter(metrics: str, name: str, *labels: str) -> float:
    """The sum of the samples called name in a /metrics body that have every one of labels (`key="value"`)."""
    return sum(metric_samples(metrics.encode(), name.encode(), None, tuple(x.encode() for x in labels)) or ())


async def prefill_times(
    engine: Engine, lengths: Sequence[int], repeats: int
) -> tuple[dict[int, float], dict[int, float]]:
    """The median time to first token of a prompt of each length, one request at a time: fresh (computed
    whole), and sent again at once (all but its last token cached: what the server's side costs)."""
    await engine.stream(engine.fresh_prompt(64), 2)  # the first request pays for warming up
    cold, warm = {}, {}
    for length in lengths:
        fresh, again = [], []
        for _ in range(repeats):
            prompt = engine.fresh_prompt(length)
            fresh.append((await engine.stream(prompt, 1)).ttft_s)
            again.append((await engine.stream(prompt, 1)).ttft_s)
        cold[length], warm[length] = statistics.median(fresh), statistics.median(again)
    return cold, warm


async def decode_steps(engine: Engine, batches: Sequence[int], tokens: int, repeats: int) -> dict[int, float]:
    """A decode step's median length with each number of requests decoding together: what answering
    `tokens` tokens takes beyond answering one, over the steps between. (A fast engine's server sends a
    burst of tokens in one chunk, so the tokens' arrivals do not time its steps.)"""
    one = statistics.median(
        [(await engine.stream(engine.fresh_prompt(32), 1)).last_token_s for _ in range(repeats)]
    )
    medians = {}
    for batch in batches:
        ends = []
        for _ in range(repeats):
            streams = await asyncio.gather(
                *(engine.stream(engine.fresh_prompt(32), tokens) for _ in range(batch))
            )
            ends.append(statistics.median(s.last_token_s for s in streams))
        medians[batch] = max(statistics.median(ends) - one, 0.0) / (tokens - 1)
    return medians
