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
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import spawn
from tests.support.agent_cli import BIN, NAMES, Run, Stack, engine_hits, one_request, running_stack

CLAUDE = BIN / "claude"
RUN_TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(
    not CLAUDE.exists(),
    reason=f"Claude Code is not installed at {CLAUDE}: run `make agent-clis`",
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    args = ["--prefill-tps", "1000000", "--decode-tps", "100000", "--max-model-len", "65536"]
    # Room for a few ~52k-token prompts; answers that end (end_turn); usage that says what was cached
    args += ["--kv-blocks", "8192", "--eos-after", "16", "--enable-prompt-tokens-details"]
    with running_stack(tmp_path_factory.mktemp("claude-code"), args) as running:
        yield running


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


def claude_run(stack: Stack, home: Path, workdir: Path, *args: str) -> Run:
    """One `claude` run that ends well, and the one Messages request it made (no count_tokens call, no side
    call), which failed nowhere."""
    run = one_request(stack, "messages", lambda: claude(stack, home, workdir, *args))
    assert run.status == "200"
    return run


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
    assert (first.program, second.program) == ("first", "first")  # two programs
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
    # One agent program (Claude Code's session id, in the body's metadata.user_id), whose KV was kept
    assert (first.program, second.program) == ("first", "kept")
    assert second.predicted_cached_tokens > 0.9 * first.prompt_tokens
    assert engine_hits(stack.fleet, NAMES.index(first.instance)) - hits == second.predicted_cached_tokens
