"""Claude Code through kvroute: `claude -p` against a simulated fleet behind the router, on Anthropic's
Messages API.

Claude Code (2.1.197, `make agent-clis`) sends `HEAD /` first (kvroute's 404 does not stop it), then one
streamed `POST /v1/messages?beta=true` per turn, with x-api-key, max_tokens 32000, adaptive thinking, 24 tools
and its system prompt: ~52k tokens with the tiny tokenizer, so the fleet's model length is raised. In print
mode it made no count_tokens call and no side call on a small model. It always names its output budget, so
--max-new-tokens cannot shorten its answers; and it takes stop_reason max_tokens for an error (it asks three
times to resume, then exits 1): the fleet's model ends every answer after 16 tokens, as with a sampled EOS
(end_turn).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.processes import Child, FleetPorts, running_fleet, running_router_process, spawn
from tests.conftest import instance_url, sample

CLAUDE = Path(sys.prefix) / "agent-clis" / "node_modules" / ".bin" / "claude"  # the venv's, `make agent-clis`
NAMES = ["fleet-0", "fleet-1"]
RUN_TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(
    not CLAUDE.exists(),
    reason=f"Claude Code is not installed at {CLAUDE}: run `make agent-clis`",
)


@dataclass(frozen=True)
class Stack:
    fleet: FleetPorts
    url: str  # kvroute's
    router: Child


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ports = FleetPorts.allocate(len(NAMES))
    tmp = tmp_path_factory.mktemp("claude-code")
    args = ["--prefill-tps", "1000000", "--decode-tps", "100000", "--max-model-len", "65536"]
    # Room for a few ~52k-token prompts; answers that end (end_turn); usage that says what was cached
    args += ["--kv-blocks", "8192", "--eos-after", "16", "--enable-prompt-tokens-details"]
    with (
        running_fleet(ports, tmp / "fleet", args),
        running_router_process(ports.router_config(), tmp / "router") as (url, router),
    ):
        yield Stack(ports, url, router)


def claude(stack: Stack, home: Path, workdir: Path, *args: str) -> tuple[int, str]:
    """Runs `claude --model tiny-llama ARGS` in its own process group (stopped, with whatever it started, on a
    timeout), as a user whose home is home, in the project workdir; its exit code and its output. Its
    environment is only this: nothing from the caller's (an API key, a Claude Code session) leaks in, and
    it reports nothing and checks for no update."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_TMPDIR": str(home / "tmp"),
        "TMPDIR": str(home / "tmp"),
        "ANTHROPIC_BASE_URL": stack.url,  # no /v1: Claude Code adds it
        "ANTHROPIC_API_KEY": "unused",  # sent as x-api-key
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "NO_COLOR": "1",
    }
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [str(CLAUDE), "--model", "tiny-llama", *args]
    child = spawn("claude", argv, home, env=env, cwd=workdir)
    try:
        rc = child.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"claude did not end within {RUN_TIMEOUT_S} s:\n{child.log_tail(60)}")
    return rc, child.log_path.read_text(errors="replace")


def requests_served(url: str) -> dict[tuple[str, str, str], float]:
    """kvroute_requests_total by (api, status, instance)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for counted in family.samples:
            if counted.name == "kvroute_requests_total":
                labels = counted.labels
                key = (labels["api"], labels["status"], labels["vllm_instance"])
                found[key] = found.get(key, 0.0) + counted.value
    return found


def total(url: str, name: str) -> float:
    """The sum of the samples called name; 0 before there is any."""
    return sample(url, name) or 0.0


def engine_hits(fleet: FleetPorts, index: int) -> float:
    """Prompt tokens the engine found in its prefix cache, as vLLM counts them."""
    return total(instance_url(fleet, index), "vllm:prefix_cache_hits_total")


def router_errors(router: Child) -> list[str]:
    text = router.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if re.search(r"\bERROR\b|Traceback", line)]


class Run(NamedTuple):
    output: str
    instance: str
    prompt_tokens: float  # as the router counted them
    predicted_cached_tokens: float


def claude_run(stack: Stack, home: Path, workdir: Path, *args: str) -> Run:
    """One `claude` run that ends well, and the one Messages request it made through the router, which failed
    nowhere."""
    before = requests_served(stack.url)
    counted = {name: total(stack.url, name) for name in (*_PER_RUN, *_FAILURES)}
    rc, output = claude(stack, home, workdir, *args)
    assert rc == 0, output
    after = requests_served(stack.url)
    new = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    ((api, status, instance),) = new  # no count_tokens call, no side call, no retry of a broken stream
    assert (api, status, new[api, status, instance]) == ("messages", "200", 1), new
    grown = {name: total(stack.url, name) - counted[name] for name in counted}
    assert {name: grown[name] for name in _FAILURES} == dict.fromkeys(_FAILURES, 0)
    assert router_errors(stack.router) == []
    return Run(output, instance, *(grown[name] for name in _PER_RUN))


_PER_RUN = ("kvroute_prompt_tokens_total", "kvroute_predicted_cached_tokens_total")
_FAILURES = ("kvroute_upstream_errors_total", "kvroute_retries_total", "kvroute_rejected_requests_total")


def result(run: Run) -> dict[str, Any]:
    """What `claude -p --output-format json` reports of its run: its answer, stop reason and usage."""
    line = next(line for line in run.output.splitlines() if line.startswith('{"type":"result"'))
    found: dict[str, Any] = json.loads(line)
    assert found["is_error"] is False and found["stop_reason"] == "end_turn", found
    return found


def test_claude_p_answers_through_kvroute(stack: Stack, tmp_path: Path) -> None:
    run = claude_run(stack, tmp_path / "home", tmp_path / "project", "-p", "say hi")
    assert run.output.strip()  # the answer it printed
    assert run.instance in NAMES
    # Routed on the prompt's tokens: Claude Code's system prompt and tools, ~52k of them.
    assert run.prompt_tokens > 40_000


def test_another_session_goes_where_claude_codes_prompt_is_cached(stack: Stack, tmp_path: Path) -> None:
    """Two sessions in one project share Claude Code's system prompt and tools, all but their last message:
    the second is routed where the first left them, predicted to hit what the engine there then reuses, and
    what the engine reports to Claude Code as read from its cache."""
    home, project = tmp_path / "home", tmp_path / "project"
    first = claude_run(stack, home, project, "-p", "say hi")
    hits = engine_hits(stack.fleet, NAMES.index(first.instance))
    second = claude_run(stack, home, project, "-p", "say bye", "--output-format", "json")
    assert second.instance == first.instance
    assert second.predicted_cached_tokens > 0.9 * second.prompt_tokens
    assert engine_hits(stack.fleet, NAMES.index(first.instance)) - hits == second.predicted_cached_tokens
    usage = result(second)["usage"]
    assert usage["cache_read_input_tokens"] == second.predicted_cached_tokens


def test_a_continued_session_goes_on_where_its_history_is_cached(stack: Stack, tmp_path: Path) -> None:
    """`claude -p --continue` sends the project's last session again, with its answer and the new prompt: it
    goes to the instance holding that history, predicted to hit what the engine there then reuses."""
    home, project = tmp_path / "home", tmp_path / "project"
    first = claude_run(stack, home, project, "-p", "say hi", "--output-format", "json")
    hits = engine_hits(stack.fleet, NAMES.index(first.instance))
    second = claude_run(
        stack, home, project, "-p", "--continue", "and now say bye", "--output-format", "json"
    )
    assert second.instance == first.instance
    assert second.prompt_tokens > first.prompt_tokens
    assert result(second)["session_id"] == result(first)["session_id"]  # one conversation, continued
    assert second.predicted_cached_tokens > 0.9 * first.prompt_tokens
    assert engine_hits(stack.fleet, NAMES.index(first.instance)) - hits == second.predicted_cached_tokens
