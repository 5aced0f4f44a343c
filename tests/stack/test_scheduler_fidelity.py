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
    "preemption": {
        "kv_blocks": 30,
        "max_num_seqs": 8,
        "max_batched_tokens": 64,
        "policy": "fcfs",
        "requests": [[80, 150, 0]] * 3,
    },
    # Long and short prompts in a small budget, a batch limit of 3, answers crossing blocks, memory tight.
    "mixed": {
        "kv_blocks": 24,
        "max_num_seqs": 3,
        "max_batched_tokens": 48,
        "policy": "fcfs",
        "requests": [[200, 20, 0], [40, 60, 0], [120, 30, 0], [60, 80, 0], [17, 40, 0], [100, 5, 0]],
    },
    # --scheduling-policy priority: the waiting queue by (priority, arrival), so later arrivals of a better
    # priority are admitted first, and the lowest-ranked running request preempted, not the last admitted
    # (first come, first served, these requests would finish 1, 0, 2, 4, 3, 5 with two preemptions).
    "priority": {
        "kv_blocks": 26,
        "max_num_seqs": 3,
        "max_batched_tokens": 48,
        "policy": "priority",
        "requests": [[80, 150, -3], [60, 120, 1], [90, 100, 3], [40, 60, -2], [30, 40, 0], [70, 90, -1]],
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
    for prompt, answer, _ in spec["requests"]:
        ids = tuple(range(first_id, first_id + -(-prompt // TRACE_BLOCK)))  # no two share a block
        first_id += len(ids)
        requests.append(TraceRequest(0.0, prompt, answer, ids))
    blocks = TraceBlocks(Trace("fidelity", TRACE_BLOCK, tuple(requests)), 16)
    loop = EventLoop()
    engine_spec = EngineSpec(
        kv_blocks=spec["kv_blocks"],
        max_num_seqs=spec["max_num_seqs"],
        max_batched_tokens=spec["max_batched_tokens"],
        scheduling_policy=spec["policy"],
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
    for number, (traced, (_, _, priority)) in enumerate(zip(requests, spec["requests"], strict=True)):
        request = SimRequest(number, traced, blocks.chains[number], None, priority=priority)
        assert engine.enqueue(request)
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
