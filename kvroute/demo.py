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
from rich.console import Console, Group
from rich.progress import Progress
from rich.table import Table

from kvroute.agent_sessions import SessionPlan, TurnOutcome, run_sessions
from kvroute.processes import FleetPorts, StartupError, running_fleet, running_router
from kvroute.workload import AgentWorkload
from router.http.proxy import POLICY_HEADER

MODEL = "tiny-llama"


@dataclass(frozen=True)
class DemoOptions:
    sessions: int = 8
    turns: int = 6
    instances: int = 3


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


def run_workload(
    base_url: str, policy: str | None, workload: AgentWorkload, on_turn: Callable[[], None]
) -> list[TurnOutcome]:
    """policy: forced on every request; None leaves each session to the router's traffic split."""
    plan = SessionPlan(
        workload, MODEL, concurrency=workload.sessions, session_prefix=f"demo-{policy or 'split'}",
        headers={} if policy is None else {POLICY_HEADER: policy}, on_turn=on_turn,
    )  # fmt: skip
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
    workload = AgentWorkload(sessions=options.sessions, turns=options.turns)
    # The A/B: the traffic split sends half the sessions to round robin, half to the default policy.
    ab_workload = AgentWorkload(sessions=max(16, 2 * options.sessions), turns=options.turns, seed=7)
    token = secrets.token_urlsafe(24)
    ports = FleetPorts.allocate(options.instances)
    config = ports.router_config(
        admin={"token": token}, traffic={"split": {"round-robin": 50, "kvroute": 50}}
    )
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
                        turns = run_workload(router_url, policy, workload, lambda: progress.advance(task))
                        hits, queries = prefix_cache_counts(instance_urls)
                        hit_rate = (hits - hits_before) / max(queries - queries_before, 1.0)
                        results.append(PolicyResult(policy, turns, hit_rate))
                    reset_prefix_caches(instance_urls)
                    _admin(router_url, "/admin/ab/reset", token, "POST")
                    progress.update(task, description="A/B: round-robin 50 / kvroute 50")
                    ab_turns = run_workload(router_url, None, ab_workload, lambda: progress.advance(task))
                ab = _admin(router_url, "/admin/ab", token)
        except StartupError as exc:
            console.print(f"[red]could not start the local fleet: {exc}")
            return 1
    console.print(_table(results, workload))
    console.print(_ab_table(ab, ab_workload))
    ok = all(t.status == "ok" for t in [*ab_turns, *(t for r in results for t in r.turns)])
    return 0 if ok else 1


def _admin(base_url: str, path: str, token: str, method: str = "GET") -> dict[str, Any]:
    request = urllib.request.Request(
        base_url + path, method=method, headers={"authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, Any] = msgspec.json.decode(response.read())
    return answer


def _ab_table(report: dict[str, Any], workload: AgentWorkload) -> Group:
    sessions = f"{workload.sessions} sessions x {workload.turns} turns"
    table = Table(title=f"A/B on live traffic (/admin/ab): {sessions}, split by session")
    for column in ("policy", "share", "requests", "errors", "rejected", "TTFT p50", "TTFT p95", "TTFT p99",
                   "e2e p50", "predicted\ncached", "engine\ncached", "requests per instance"):  # fmt: skip
        table.add_column(column)
    for name, result in report["policies"].items():
        ttft, e2e = result["ttft_ms"], result["e2e_ms"]
        cached = result["predicted_cached_tokens"] / max(result["prompt_tokens"], 1)
        observed = result["observed_prompt_tokens"]  # None: no answer's usage reported it
        engine = "-" if not observed else f"{result['observed_cached_tokens'] / observed:.1%}"
        table.add_row(
            name, f"{report['split'][name]:.0%}", str(result["requests"]), str(result["errors"]),
            str(result["rejected"]), _ms(ttft["p50"]), _ms(ttft["p95"]), _ms(ttft["p99"]), _ms(e2e["p50"]),
            f"{cached:.1%}", engine, " ".join(f"{k}:{v}" for k, v in result["requests_per_instance"].items()),
        )  # fmt: skip
    verdicts = [f"verdict: {c['verdict']}" for c in report["comparisons"]]
    return Group(table, *verdicts)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _table(results: list[PolicyResult], workload: AgentWorkload) -> Table:
    table = Table(
        title=f"{workload.sessions} agent sessions x {workload.turns} turns, shared system prompt, streaming"
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
