"""What the real agent CLIs' tests share (test_codex_cli.py, test_claude_code_cli.py): a simulated fleet with
kvroute in front, and one CLI run read from the router's metrics: the one request it made, where it went,
what the router predicted, and that nothing failed on the way."""

from __future__ import annotations

import contextlib
import re
import sys
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvroute.processes import Child, FleetPorts, running_fleet, running_router_process
from tests.conftest import instance_url

BIN = Path(sys.prefix) / "agent-clis" / "node_modules" / ".bin"  # the venv's, `make agent-clis`
NAMES = ["fleet-0", "fleet-1"]
_PER_RUN = ("kvroute_prompt_tokens_total", "kvroute_predicted_cached_tokens_total")
_FAILURES = ("kvroute_upstream_errors_total", "kvroute_retries_total", "kvroute_rejected_requests_total")


@dataclass(frozen=True)
class Stack:
    fleet: FleetPorts
    url: str  # kvroute's
    router: Child


@contextlib.contextmanager
def running_stack(tmp: Path, fleet_args: Sequence[str]) -> Iterator[Stack]:
    ports = FleetPorts.allocate(len(NAMES))
    with (
        running_fleet(ports, tmp / "fleet", fleet_args),
        running_router_process(ports.router_config(), tmp / "router") as (url, router),
    ):
        yield Stack(ports, url, router)


class Run(NamedTuple):
    output: str
    status: str
    instance: str
    prompt_tokens: float  # as the router counted them
    predicted_cached_tokens: float
    # What it was as a turn of an agent program: first (a new program), or what it found of the KV its
    # program's last turn left (kept, elsewhere, lost: router/programs/table.py); None: no program
    program: str | None


def one_request(stack: Stack, api: str, run: Callable[[], tuple[int, str]]) -> Run:
    """run (a CLI's exit code and output) ends well, having made one request of api through the router
    (no side call, no retry of a broken stream), which failed nowhere."""
    before = requests_served(stack.url)
    counted = {name: total(stack.url, name) for name in (*_PER_RUN, *_FAILURES)}
    turns = program_turns(stack.url)
    rc, output = run()
    assert rc == 0, output
    after = requests_served(stack.url)
    new = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    ((served, status, instance),) = new
    assert (served, new[served, status, instance]) == (api, 1), new
    grown = {name: total(stack.url, name) - counted[name] for name in counted}
    assert {name: grown[name] for name in _FAILURES} == dict.fromkeys(_FAILURES, 0)
    assert router_errors(stack.router) == []
    grown_turns = [kv for kv, n in program_turns(stack.url).items() if n != turns.get(kv, 0)]
    assert len(grown_turns) <= 1, grown_turns
    program = grown_turns[0] if grown_turns else None
    return Run(output, status, instance, *(grown[name] for name in _PER_RUN), program)


def program_turns(url: str) -> dict[str, float]:
    """kvroute_program_turns_total by what the turns found of their program's KV (first for a new one)."""
    found: dict[str, float] = {}
    for counted in _samples(url, "kvroute_program_turns_total"):
        found[counted.labels["kv"]] = found.get(counted.labels["kv"], 0.0) + counted.value
    return found


def requests_served(url: str) -> dict[tuple[str, str, str], float]:
    """kvroute_requests_total by (api, status, instance)."""
    found: dict[tuple[str, str, str], float] = {}
    for counted in _samples(url, "kvroute_requests_total"):
        key = (counted.labels["api"], counted.labels["status"], counted.labels["vllm_instance"])
        found[key] = found.get(key, 0.0) + counted.value
    return found


def total(url: str, name: str) -> float:
    """The sum of the samples called name; 0 before there is any."""
    return sum(found.value for found in _samples(url, name))


def engine_hits(fleet: FleetPorts, index: int) -> float:
    """Prompt tokens the engine found in its prefix cache, as vLLM counts them."""
    return total(instance_url(fleet, index), "vllm:prefix_cache_hits_total")


def router_errors(router: Child) -> list[str]:
    text = router.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if re.search(r"\bERROR\b|Traceback", line)]


def _samples(url: str, name: str) -> list[Sample]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return [
        found
        for family in text_string_to_metric_families(text)
        for found in family.samples
        if found.name == name
    ]
