"""The simulated engine (kvroute/simulate/engine.py) against the installed vLLM's V1 scheduler, step by
step: the same requests, the same KV blocks, budget and batch limit; what each step scheduled, whom it
preempted, in what order requests finished, and how many blocks the KV events announced (answers' blocks
included). tests/stack/vllm_scheduler_steps.py drives vLLM's Scheduler with no model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.engine import Engine, SimRequest
from kvroute.simulate.hardware import EngineSpec
from kvroute.stack.config import load_stack_config
from kvroute.traces import Trace, TraceRequest
from router.index.events import BlockStored, KVEvent
from tests.stack.conftest import CONFIG, REPO
from tinymodel.builder import ensure_model

pytestmark = pytest.mark.stack

TRACE_BLOCK = 32

SCENARIOS = {
    # Three answers outgrow 30 blocks: the request admitted last is preempted and computed again.
    "preemption": {"kv_blocks": 30, "max_num_seqs": 8, "max_batched_tokens": 64, "requests": [[80, 150]] * 3},
    # Long and short prompts in a small budget, a batch limit of 3, answers crossing blocks, memory tight.
    "mixed": {
        "kv_blocks": 24,
        "max_num_seqs": 3,
        "max_batched_tokens": 48,
        "requests": [[200, 20], [40, 60], [120, 30], [60, 80], [17, 40], [100, 5]],
    },
}


def vllm_run(spec: dict[str, Any]) -> dict[str, Any]:
    answer = subprocess.run(
        [
            str(load_stack_config(CONFIG).python_path(REPO)),
            str(Path(__file__).with_name("vllm_scheduler_steps.py")),
        ],
        input=json.dumps({**spec, "block_size": 16, "model": str(ensure_model())}),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    ran = json.loads(answer.stdout.strip().splitlines()[-1])
    ran["steps"] = [{int(n): tokens for n, tokens in step.items()} for step in ran["steps"] if step]
    return ran  # type: ignore[no-any-return]


def simulated_run(spec: dict[str, Any]) -> dict[str, Any]:
    requests, first_id = [], 0
    for prompt, answer in spec["requests"]:
        ids = tuple(range(first_id, first_id + -(-prompt // TRACE_BLOCK)))  # no two share a block
        first_id += len(ids)
        requests.append(TraceRequest(0.0, prompt, answer, ids))
    blocks = TraceBlocks(Trace("fidelity", TRACE_BLOCK, tuple(requests)), 16)
    loop = EventLoop()
    engine_spec = EngineSpec(
        kv_blocks=spec["kv_blocks"],
        max_num_seqs=spec["max_num_seqs"],
        max_batched_tokens=spec["max_batched_tokens"],
    )
    engine = Engine(0, engine_spec, blocks, loop)
    steps: list[dict[int, int]] = []
    preempted: list[int] = []
    finished: list[int] = []
    stored = [0]

    def announced(events: list[KVEvent]) -> None:
        stored[0] += sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))

    engine.on_step = lambda scheduled: steps.append({r.number: tokens for r, tokens in scheduled})
    engine.on_preempted = lambda request: preempted.append(request.number)
    engine.on_finish = lambda request: finished.append(request.number)
    engine.on_events = announced
    for number, traced in enumerate(requests):
        assert engine.enqueue(SimRequest(number, traced, blocks.chains[number], None))
    loop.run()
    return {"steps": steps, "preempted": preempted, "finished": finished, "stored_blocks": stored[0]}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_simulated_engine_schedules_as_vllms_scheduler(name: str) -> None:
    real, simulated = vllm_run(SCENARIOS[name]), simulated_run(SCENARIOS[name])
    assert real["preempted"] and len(real["steps"]) > 100  # both scenarios preempt, over many steps
    assert simulated["preempted"] == real["preempted"]
    assert simulated["finished"] == real["finished"]
    assert simulated["stored_blocks"] == real["stored_blocks"]
    assert simulated["steps"] == real["steps"]
