"""README's "In front of your vLLM fleet", run as written against the real stack's two vLLM instances.

The section's commands run unchanged but for the example's addresses, model name and port, replaced by the
stack's. Its vLLM command is not run (the stack started the engines): its flags are checked against the ones
the stack gave them. The routers these commands start are this test's own, stopped by process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import free_port_block
from kvroute.stack.run import Stack
from tests.stack.client import metric, wait_steady

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## In front of your vLLM fleet"
EXAMPLE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
EXAMPLE_PORT = "8080"
HITS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")  # local, and from the pool
STACK_INSTANCES = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")  # the example's, each a stack's instance


def _section_blocks() -> list[str]:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return re.findall(r"```bash\n(.*?)```", text[start : end if end > 0 else None], re.S)


def _commands(block: str) -> list[str]:
    """A block's shell commands: continued lines joined, a here-document with its body."""
    commands: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        command = line
        while command.endswith("\\"):
            command = command[:-1] + next(lines)
        if "<<'EOF'" in command:
            body = list(iter(lambda: next(lines), "EOF"))
            command = "\n".join([command, *body, "EOF"])
        if command.strip():
            commands.append(command)
    return commands


def _substitutions(stack: Stack, router_port: int) -> dict[str, str]:
    """The example's addresses and names -> the stack's."""
    first, second = stack.instances
    return {
        STACK_INSTANCES[0]: first.url,
        STACK_INSTANCES[1]: second.url,
        "tcp://10.0.0.1:5557": first.events,
        "tcp://10.0.0.2:5557": second.events,
        "tcp://10.0.0.1:5558": first.replay,
        "tcp://10.0.0.2:5558": second.replay,
        EXAMPLE_MODEL: stack.plan.config.model.served_name,
        f"127.0.0.1:{EXAMPLE_PORT}": f"127.0.0.1:{router_port}",
        f"--port {EXAMPLE_PORT}": f"--port {router_port}",
    }


class Shell:
    """Runs the README's commands in one directory, with this checkout's kvroute first on the PATH."""

    def __init__(self, cwd: Path, substitutions: dict[str, str]) -> None:
        self.cwd = cwd
        self.substitutions = substitutions
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.servers: list[subprocess.Popen[bytes]] = []

    def concrete(self, command: str) -> str:
        for example, actual in self.substitutions.items():
            command = command.replace(example, actual)
        return command

    def run(self, command: str) -> str:
        done = subprocess.run(
            ["bash", "-c", self.concrete(command)],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{command!r} failed: {done.stderr.decode()[-2000:]}"
        return done.stdout.decode()

    def serve(self, command: str, log: Path) -> subprocess.Popen[bytes]:
        """A server command, in its own process group, answering /health within a minute."""
        with log.open("wb") as out, log.with_suffix(".err").open("wb") as err:
            server = subprocess.Popen(
                ["bash", "-c", f"exec {self.concrete(command)}"],
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.servers.append(server)
        port = int(re.search(r"--port (\d+)", self.concrete(command))[1])  # type: ignore[index]
        deadline = time.monotonic() + 60
        # Up, and its index warm: each engine's replayed events applied (the chats' blocks were sent before)
        while not _warm(f"http://127.0.0.1:{port}"):
            said = log.with_suffix(".err").read_text()[-2000:]
            assert server.poll() is None, f"{command!r} exited: {said}"
            assert time.monotonic() < deadline, f"{command!r} never answered: {said}"
            time.sleep(0.2)
        return server

    def stop(self, server: subprocess.Popen[bytes]) -> None:
        """The server's whole process group (its workers too, were it to have exited before them)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _warm(router: str) -> bool:
    try:
        return metric(router, "kvroute_kv_warm") == len(STACK_INSTANCES)
    except OSError:
        return False


@pytest.fixture
def shell(stack: Stack, tmp_path: Path) -> Iterator[Shell]:
    commands = Shell(tmp_path, _substitutions(stack, free_port_block(1)))
    try:
        yield commands
    finally:
        for server in commands.servers:
            commands.stop(server)


def test_the_readme_names_the_flags_the_stack_runs_vllm_with(stack: Stack) -> None:
    vllm, *_ = _section_blocks()
    words = shlex.split(vllm.replace("\\\n", " "))
    argv = stack.plan.vllm_argv(0)
    flags = [word for word in words if word.startswith("--") and word != "--port"]
    assert "--enable-prefix-caching" in flags and "--kv-events-config" in flags
    assert [flag for flag in flags if flag not in argv] == []
    readme_events = json.loads(words[words.index("--kv-events-config") + 1])
    stack_events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert {k: stack_events[k] for k in ("enable_kv_cache_events", "publisher")} == {
        k: readme_events[k] for k in ("enable_kv_cache_events", "publisher")
    }
    # vLLM binds the PUB socket only for an endpoint with '*' or '::' (it connects otherwise)
    for events in (readme_events, stack_events):
        assert "*" in events["endpoint"] or "::" in events["endpoint"]
        assert events["replay_endpoint"]


def test_the_readme_brings_kvroute_up_and_its_cached_blocks_are_the_engines_hits(
    stack: Stack, shell: Shell, tmp_path: Path
) -> None:
    _, from_workers, from_file, check = _section_blocks()
    examples = "".join(_section_blocks())
    assert [name for name in shell.substitutions if name not in examples] == [], (
        "the README's example changed"
    )

    (serve,) = _commands(from_workers)
    router = shell.serve(serve, tmp_path / "from-workers.log")
    _check_cached_blocks(stack, shell, _commands(check))
    shell.stop(router)

    # "It prints the configuration it made. Keep it as kvroute.yaml"
    printed = (tmp_path / "from-workers.log").read_text()
    (tmp_path / "kvroute.yaml").write_text(
        printed[printed.index("\n", printed.index("# the configuration")) + 1 :]
    )
    check_config, serve_file = _commands(from_file)
    assert "ok" in shell.run(check_config)
    shell.serve(serve_file, tmp_path / "from-file.log")
    _check_cached_blocks(stack, shell, _commands(check))


def _check_cached_blocks(stack: Stack, shell: Shell, commands: list[str]) -> None:
    """The chat written, sent twice, each answer's cached blocks equal to its engine's hits; the metrics
    command shows the engine's counter."""
    write_chat, *sends, show_metrics = commands
    shell.run(write_chat)
    urls = {instance.name: instance.url for instance in stack.instances}
    cached = []
    for send in sends:
        before = {url: _hits(url) for url in urls.values()}
        headers = dict(
            line.strip().split(": ", 1)
            for line in shell.run(send).lower().splitlines()
            if line.startswith("x-kvroute-")
        )
        served = _instance_url(headers["x-kvroute-instance"], urls)
        hits = wait_steady(lambda url=served: _hits(url)) - before[served]  # type: ignore[misc]
        assert int(headers["x-kvroute-cached-blocks"]) * stack.plan.config.block_size == hits, headers
        cached.append(int(headers["x-kvroute-cached-blocks"]))
    assert cached[-1] > 0, "the second send found nothing cached"
    assert "vllm:prefix_cache_hits_total" in shell.run(show_metrics)


def _hits(url: str) -> float:
    return sum(metric(url, name) for name in HITS)


def _instance_url(named: str, urls: dict[str, str]) -> str:
    """The instance an answer names: the stack's name, or the host-port name --worker-urls gives it."""
    for name, url in urls.items():
        if named in (name, url.removeprefix("http://").replace(":", "-")):
            return url
    raise AssertionError(f"{named} is none of {sorted(urls)}")
