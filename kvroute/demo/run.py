"""``kvroute demo``: a local fleet, the router, and an agentic workload driven through every policy."""

from __future__ import annotations

import asyncio
import secrets
import statistics
import tempfile
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvroute.agent_apis import Api
from kvroute.agent_sessions import SessionPlan, TurnOutcome, run_sessions
from kvroute.demo import ab as demo_ab
from kvroute.processes import FleetPorts, StartupError, running_fleet, running_router
from kvroute.workload import AgentWorkload
from router.dispatch.observe.routing_headers import POLICY_HEADER
from router.traffic_split import TrafficSplit

MODEL = "tiny-llama"
# An agent's turn adds a tool output (a file read, a test log) of 500 to 1,000 tokens to a history it resends
# whole, after a 1,400-token system prompt every session shares. Shorter ones leave the shared prompt most
# of every request, which any policy finds cached.
TOOL_OUTPUT_WORDS = (150, 300)
# Tools take from 0 to 1 s between turns. With a fixed pause, sessions started together send every turn
# together: bursts on whichever instance holds several of them, which says more about the start than the
# policy.
THINK_TIME_JITTER_S = 1.0


@dataclass(frozen=True)
class DemoOptions:
    sessions: int = 8
    turns: int = 6
    instances: int = 3
    api: Api = "chat"  # the sessions' API: chat completions, or the agents' Responses or Messages


@dataclass
class PolicyResult:
    policy: str
    turns: list[TurnOutcome] = field(default_factory=list)
    hit_rate: float = 0.0

    def ttft_quantile(self, q: float) -> float:
        values = sorted(t.ttft_s for t in self.turns if t.status == "ok")
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]


def agent_workload(sessions: int, turns: int, seed: int = 0) -> AgentWorkload:
    low, high = TOOL_OUTPUT_WORDS
    return AgentWorkload(
        sessions=sessions,
        turns=turns,
        min_turn_words=low,
        max_turn_words=high,
        think_time_jitter_s=THINK_TIME_JITTER_S,
        seed=seed,
    )


def run_workload(
    base_url: str,
    policy: str | None,
    workload: AgentWorkload,
    concurrency: int,
    on_turn: Callable[[], None],
    api: Api = "chat",
) -> list[TurnOutcome]:
    """policy: forced on every request; None leaves each session to the router's traffic split."""
    plan = SessionPlan(
        workload,
        MODEL,
        concurrency=concurrency,
        session_prefix=demo_ab.SESSION_PREFIX if policy is None else f"demo-{policy}",
        headers={} if policy is None else {POLICY_HEADER: policy},
        on_turn=on_turn,
        api=api,
    )
    return asyncio.run(run_sessions(base_url, plan)).outcomes


def prefix_cache_counts(instance_urls: list[str]) -> tuple[float, float]:
    """Summed (hits, queries) of vLLM's prefix-cache token counters over the instances."""
    hits = queries = 0.0
    for url in instance_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


def reset_prefix_caches(instance_urls: list[str]) -> None:
    for url in instance_urls:
        request = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
        urllib.request.urlopen(request, timeout=5).close()


def run_demo(options: DemoOptions) -> int:
    console = Console(width=None if Console().is_terminal else 150)
    workload = agent_workload(options.sessions, options.turns)
    # The A/B: the traffic split sends each session to round robin or the default policy, at the load each
    # policy had alone (as many sessions at a time), with enough sessions for a verdict.
    per_policy = demo_ab.sessions_per_policy(options.turns, at_least=2 * options.sessions)
    ab_sessions = demo_ab.sessions_for_split(TrafficSplit(demo_ab.SPLIT), demo_ab.SEED, per_policy)
    ab_workload = agent_workload(ab_sessions, options.turns, demo_ab.SEED)
    token = secrets.token_urlsafe(24)
    ports = FleetPorts.allocate(options.instances)
    config = ports.router_config(admin={"token": token}, traffic={"split": demo_ab.SPLIT})
    instance_urls = [f"http://127.0.0.1:{ports.http + i}" for i in range(options.instances)]
    policies = ["round-robin", "least-loaded", "precise-prefix", "kvroute"]
    results: list[PolicyResult] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-demo-") as tmp:
        log_dir = Path(tmp)
        console.print(f"starting {options.instances} simulated vLLM instances and the router ...")
        try:
            # The engines' usage says what they found cached: the A/B's engine hit rate.
            fleet = running_fleet(ports, log_dir, ["--enable-prompt-tokens-details"])
            with fleet, running_router(config, log_dir) as router_url:
                total = workload.requests * len(policies) + ab_workload.requests
                with Progress(console=console, transient=True) as progress:
                    task = progress.add_task("agentic sessions", total=total)
                    for policy in policies:
                        reset_prefix_caches(instance_urls)
                        hits_before, queries_before = prefix_cache_counts(instance_urls)
                        progress.update(task, description=f"policy {policy}")
                        turns = run_workload(
                            router_url,
                            policy,
                            workload,
                            workload.sessions,
                            lambda: progress.advance(task),
                            options.api,
                        )
                        hits, queries = prefix_cache_counts(instance_urls)
                        hit_rate = (hits - hits_before) / max(queries - queries_before, 1.0)
                        results.append(PolicyResult(policy, turns, hit_rate))
                    reset_prefix_caches(instance_urls)
                    _admin(router_url, "/admin/ab/reset", token, "POST")
                    split = " / ".join(f"{name} {weight}" for name, weight in demo_ab.SPLIT.items())
                    progress.update(task, description=f"A/B: {split}")
                    ab_turns = run_workload(
                        router_url,
                        None,
                        ab_workload,
                        workload.sessions,
                        lambda: progress.advance(task),
                        options.api,
                    )
                ab = _admin(router_url, "/admin/ab", token)
        except StartupError as exc:
            console.print(f"[red]could not start the local fleet: {exc}")
            return 1
    console.print(_table(results, workload))
    console.print(demo_ab.ab_table(ab, ab_workload, workload.sessions))
    for comparison in ab["comparisons"]:
        console.print(f"verdict: {comparison['verdict']}")
        console.print(demo_ab.verdict_meaning(ab, comparison))
    ok = all(t.status == "ok" for t in [*ab_turns, *(t for r in results for t in r.turns)])
    return 0 if ok else 1


def _admin(base_url: str, path: str, token: str, method: str = "GET") -> dict[str, Any]:
    request = urllib.request.Request(
        base_url + path, method=method, headers={"authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, Any] = msgspec.json.decode(response.read())
    return answer


def _table(results: list[PolicyResult], workload: AgentWorkload) -> Table:
    low, high = TOOL_OUTPUT_WORDS
    shape = f"{workload.sessions} agent sessions x {workload.turns} turns at once"
    table = Table(
        title=f"Each policy alone: {shape}, shared system prompt, {low}-{high}-word tool outputs, history "
        "resent every turn, streaming"
    )
    for column in (
        "policy",
        "requests",
        "failed",
        "TTFT p50",
        "TTFT p99",
        "e2e p50",
        "prefix hit rate",
        "requests per instance",
    ):
        table.add_column(column)
    for result in results:
        ok = [t for t in result.turns if t.status == "ok"]
        spread = Counter(t.instance for t in ok)
        table.add_row(
            result.policy,
            str(len(result.turns)),
            str(len(result.turns) - len(ok)),
            f"{result.ttft_quantile(0.5) * 1000:.0f} ms",
            f"{result.ttft_quantile(0.99) * 1000:.0f} ms",
            f"{statistics.median(t.e2e_s for t in ok) * 1000:.0f} ms" if ok else "-",
            f"{result.hit_rate:.1%}",
            " ".join(f"{name}:{count}" for name, count in sorted(spread.items())),
        )
    return table
