"""Codex CLI through kvroute: `codex exec` against a simulated fleet behind the router, on the Responses API.

Codex (0.169, `make agent-clis`) posts every turn to {base_url}/responses as a stream, with the whole history
again (no previous_response_id); a turn ends only on `response.completed`. Its prompt is ~25k tokens of
system prompt and tool definitions, so the fleet's model length is raised; it names no output budget, so the
fleet gives it 16 tokens (vLLM's max_new_tokens generation config).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import spawn
from tests.support.agent_cli import BIN, NAMES, Run, Stack, engine_hits, one_request, running_stack

CODEX = BIN / "codex"
TURN_TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(
    not CODEX.exists(),
    reason=f"Codex CLI is not installed at {CODEX}: run `make agent-clis`",
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Codex names no output budget: the engines give it 16 tokens, as vLLM's generation config can
    args = ["--prefill-tps", "1000000", "--decode-tps", "100000", "--max-model-len", "40000"]
    # Room for several ~25k-token sessions' working sets: a new session goes where the instructions are
    # cached while that instance has room for it (scorers/program_room.py), not to one it would crowd out
    args += ["--kv-blocks", "8192"]
    with running_stack(tmp_path_factory.mktemp("codex"), [*args, "--max-new-tokens", "16"]) as running:
        yield running


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


def codex_turn(stack: Stack, home: Path, workdir: Path, *args: str) -> Run:
    """One `codex exec` that ends well, and the one Responses request it made (Codex sends a turn again when
    its stream breaks), which failed nowhere."""
    return one_request(stack, "responses", lambda: codex(home, workdir, *args))


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
    assert (first.program, second.program) == ("first", "first")  # two programs
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
    # One agent program (Codex's session id, its prompt_cache_key), whose KV was kept
    assert (first.program, second.program) == ("first", "kept")
    assert second.predicted_cached_tokens > 0.9 * first.prompt_tokens
    assert engine_hits(stack.fleet, NAMES.index(first.instance)) - hits == second.predicted_cached_tokens
