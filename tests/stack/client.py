"""HTTP and metrics helpers for the stack tests: requests to the router or one instance, TTFT, waiting."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-llama"
BLOCK = 32
INSTANCE_HEADER = "x-kvroute-instance"
CACHED_HEADER = "x-kvroute-cached-blocks"
POLICY_HEADER = "x-kvroute-policy"


@dataclass(frozen=True)
class Reply:
    headers: dict[str, str]  # lower-case names
    body: Any
    ttft_s: float  # to the first body chunk (streamed: the first SSE event)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    """Token ids of the tiny model's vocabulary, special tokens (0-2) left out."""
    return [rng.randrange(3, 512) for _ in range(count)]


def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 120
) -> Reply:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        first = response.readline() if body.get("stream") else b""
        ttft = time.perf_counter() - started
        raw = first + response.read()
        names = {k.lower(): v for k, v in response.headers.items()}
    return Reply(names, raw.decode() if body.get("stream") else json.loads(raw), ttft)


def complete(
    base: str, prompt: list[int], headers: dict[str, str] | None = None, stream: bool = False
) -> Reply:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if stream:
        body["stream"] = True
    return post(base + "/v1/completions", body, headers)


METRICS_TIMEOUT_S = 30.0


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of the samples called name (counters end in _total) whose labels include labels."""
    # Generous: two engines, the master and the router share two cores, and one full run saw every
    # process there stall for over 10 s at once (the router and an engine both late on /metrics)
    with urllib.request.urlopen(base + "/metrics", timeout=METRICS_TIMEOUT_S) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def wait_steady(read: Callable[[], float], quiet_s: float = 1.0, timeout_s: float = 60.0) -> float:
    """read() once it has not changed for quiet_s (events and counters land shortly after a response)."""
    deadline = time.monotonic() + timeout_s
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline:
            raise AssertionError(f"still changing after {timeout_s:.0f}s (last {value})")
        time.sleep(0.1)
        current = read()
        if current != value:
            value, since = current, time.monotonic()
    return value
