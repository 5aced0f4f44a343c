"""Codex CLI through kvroute: `codex exec` against a simulated fleet behind the router, on the Responses API.

Codex (0.169, `make agent-clis`) posts every turn to {base_url}/responses as a stream, with the whole history
again (no previous_response_id); a turn ends only on `response.completed`. Its prompt is ~25k tokens of
system prompt and tool definitions, so the fleet's model length is raised, and its decoding is fast: the
simulated engine does not stop before its length runs out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.processes import Child, FleetPorts, running_fleet, running_router_process, spawn
from tests.conftest import instance_url

CODEX = Path(sys.prefix) / "agent-clis" / "node_modules" / ".bin" / "codex"  # the venv's, `make agent-clis`
NAMES = ["fleet-0", "fleet-1"]
TURN_TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(
    not CODEX.exists(),
    reason=f"Codex CLI is not installed at {CODEX}: run `make agent-clis`",
)


@dataclass(frozen=True)
class Stack:
    fleet: FleetPorts
    url: str  # kvroute's
    router: Child


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ports = FleetPorts.allocate(len(NAMES))
    tmp = tmp_path_factory.mktemp("codex")
    # Codex names no output budget: the engines give it 16 tokens, as vLLM's generation config can
    args = ["--prefill-tps", "1000000", "--decode-tps", "100000", "--max-model-len", "40000"]
    args += ["--max-new-tokens", "16"]
    with (
        running_fleet(ports, tmp / "fleet", args),
        running_router_process(ports.router_config(), tmp / "router") as (url, router),
    ):
        yield Stack(ports, url, router)


def codex_home(path: Path, url: str) -> Path:
    """A CODEX_HOME whose provider is kvroute (Codex sends $KVROUTE_API_KEY as its Bearer key), and which
    reports nothing to OpenAI."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.toml").write_text(
        'model = "tiny-llama"\n'
        'model_provider = "kvroute"\n'
        "check_for_update_on_startup = false\n"
        "[analytics]\n"
        "enabled = false\n"
        "[model_providers.kvroute]\n"
        'name = "kvroute"\n'
        f'base_url = "{url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "KVROUTE_API_KEY"\n'
    )
    return path


def codex(home: Path, workdir: Path, *args: str) -> tuple[int, str]:
    """Runs `codex exec ARGS` in its own process group (stopped, with whatever it started, on a timeout);
    its exit code and its output."""
    env = {
        **os.environ,
        "CODEX_HOME": str(home),
        "HOME": str(home.parent),
        "KVROUTE_API_KEY": "unused",
        "NO_COLOR": "1",
    }
    argv = [str(CODEX), "exec", "--strict-config", "--skip-git-repo-check", "--color", "never", *args]
    child = spawn("codex", argv, workdir, env=env, cwd=workdir)
    try:
        rc = child.wait(TURN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"codex did not end within {TURN_TIMEOUT_S} s:\n{child.log_tail(60)}")
    return rc, child.log_path.read_text(errors="replace")


def by_labels(url: str, name: str, keys: tuple[str, ...], **labels: str) -> dict[tuple[str, ...], float]:
    """The samples called name whose labels include labels, summed by their values of keys."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                key = tuple(sample.labels.get(k, "") for k in keys)
                found[key] = found.get(key, 0.0) + sample.value
    return found


def total(url: str, name: str) -> float:
    return sum(by_labels(url, name, ()).values())


def responses_served(url: str) -> dict[tuple[str, ...], float]:
    """kvroute_requests_total of the Responses API, by (status, instance)."""
    return by_labels(url, "kvroute_requests_total", ("status", "vllm_instance"), api="responses")


def engine_hits(fleet: FleetPorts, index: int) -> float:
    """Prompt tokens the engine found in its prefix cache, as vLLM counts them."""
    return total(instance_url(fleet, index), "vllm:prefix_cache_hits_total")


def router_errors(router: Child) -> list[str]:
    text = router.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if re.search(r"\bERROR\b|Traceback", line)]


class Turn(NamedTuple):
    status: str
    instance: str
    prompt_tokens: float  # as the router counted them
    predicted_cached_tokens: float


def codex_turn(stack: Stack, home: Path, workdir: Path, *args: str) -> Turn:
    """One `codex exec` that ends well, and the one request it made through the router, which failed nowhere."""
    before = responses_served(stack.url)
    counted = {name: total(stack.url, name) for name in (*_PER_TURN, *_FAILURES)}
    rc, output = codex(home, workdir, *args)
    assert rc == 0, output
    after = responses_served(stack.url)
    new = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    assert sum(new.values()) == 1, new  # one request: Codex sends a turn again when its stream breaks
    ((status, instance),) = new
    grown = {name: total(stack.url, name) - counted[name] for name in counted}
    assert {name: grown[name] for name in _FAILURES} == dict.fromkeys(_FAILURES, 0)
    assert router_errors(stack.router) == []
    return Turn(status, instance, *(grown[name] for name in _PER_TURN))


_PER_TURN = ("kvroute_prompt_tokens_total", "kvroute_predicted_cached_tokens_total")
_FAILURES = ("kvroute_upstream_errors_total", "kvroute_retries_total", "kvroute_rejected_requests_total")


def test_codex_exec_answers_through_kvroute(stack: Stack, tmp_path: Path) -> None:
    home = codex_home(tmp_path / "codex-home", stack.url)
    last = tmp_path / "last-message.txt"
    turn = codex_turn(stack, home, tmp_path, "--output-last-message", str(last), "say hi")
    assert last.read_text().strip()  # the answer Codex kept (from response.output_item.done)
    assert turn.status == "200" and turn.instance in NAMES
    # Routed on the prompt's tokens: Codex's instructions and tools, ~25k of them.
    assert turn.prompt_tokens > 10_000


def test_another_session_goes_where_codexs_instructions_are_cached(stack: Stack, tmp_path: Path) -> None:
    """Two sessions share Codex's instructions and tools, most of their prompts: the second is routed where
    the first left them, predicted to hit what the engine there then reuses."""
    first = codex_turn(stack, codex_home(tmp_path / "first", stack.url), tmp_path, "say hi")
    hits = engine_hits(stack.fleet, NAMES.index(first.instance))
    second = codex_turn(stack, codex_home(tmp_path / "second", stack.url), tmp_path, "say bye")
    assert second.status == "200" and second.instance == first.instance
    assert second.predicted_cached_tokens > 0.8 * second.prompt_tokens
    assert engine_hits(stack.fleet, NAMES.index(first.instance)) - hits == second.predicted_cached_tokens


def test_a_resumed_session_goes_on_where_its_history_is_cached(stack: Stack, tmp_path: Path) -> None:
    """`codex exec resume` sends the session's whole history again, with the answer and the new prompt: it
    goes to the instance holding the history, predicted to hit what the engine there then reuses."""
    home = codex_home(tmp_path / "home", stack.url)
    first = codex_turn(stack, home, tmp_path, "say hi")
    hits = engine_hits(stack.fleet, NAMES.index(first.instance))
    second = codex_turn(stack, home, tmp_path, "resume", "--last", "and now say bye")
    assert second.status == "200" and second.instance == first.instance
    assert second.prompt_tokens > first.prompt_tokens
    assert second.predicted_cached_tokens > 0.9 * first.prompt_tokens
    assert engine_hits(stack.fleet, NAMES.index(first.instance)) - hits == second.predicted_cached_tokens
