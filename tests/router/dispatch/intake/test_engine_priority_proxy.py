"""Through `kvroute serve` to a simulated instance run with `--scheduling-policy priority`: the objective's
priority reaches the engine, so an interactive request queued at the engine behind a batch flood runs next;
with `engine_priority: false` it waits behind all of it. Flow control is off, so the router's own queue
orders nothing here."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvroute.processes import FleetPorts, running_fleet, running_router
from tests.conftest import instance_url, sample
from tests.support.http import post
from tests.support.waiting import eventually

OBJECTIVE = "x-gateway-inference-objective"
BATCH = 3  # queued at the engine behind the one running


def completion(first_token: int, max_tokens: int) -> bytes:
    body = {"model": "tiny-llama", "prompt": [first_token] * 40, "max_tokens": max_tokens}
    return json.dumps(body).encode()


@pytest.mark.parametrize("engine_priority", [True, False])
def test_an_interactive_request_jumps_the_engines_queue_of_batch_requests(
    tmp_path: Path, engine_priority: bool
) -> None:
    ports = FleetPorts.allocate(1)
    engine = ["--max-num-seqs", "1", "--scheduling-policy", "priority", "--decode-tps", "50"]
    flow_control = {
        "enabled": False,
        "engine_priority": engine_priority,
        "objectives": {"interactive": {"priority": 10}, "batch": {"priority": -10}},
    }
    with (
        running_fleet(ports, tmp_path, engine),
        running_router(ports.router_config(flow_control=flow_control), tmp_path) as url,
    ):
        finished: list[str] = []

        def send(name: str, first_token: int, max_tokens: int, objective: str) -> None:
            status, _, _ = post(
                url + "/v1/completions", completion(first_token, max_tokens), {OBJECTIVE: objective}
            )
            assert status == 200
            finished.append(name)

        engine_url = instance_url(ports, 0)

        def sent(
            name: str, first_token: int, max_tokens: int, objective: str, in_flight: int
        ) -> threading.Thread:
            thread = threading.Thread(target=send, args=(name, first_token, max_tokens, objective))
            thread.start()
            eventually(lambda: sample(url, "kvroute_instance_in_flight") == in_flight, what=f"{name} sent")
            # and in the engine's queue (the one running aside), not still on its way there
            queued = in_flight - 1
            eventually(
                lambda: sample(engine_url, "vllm:num_requests_waiting") == queued, what=f"{name} queued"
            )
            return thread

        # 3 s of decode: the others must all be queued before it ends, and each is sent only once the
        # router's /metrics shows the one before (slow when another test run shares the cores).
        threads = [sent("running", 1, 150, "batch", 1)]
        # Running at the engine before the others come, not waiting among them (a busy engine's step is late).
        eventually(lambda: sample(engine_url, "vllm:num_requests_running") == 1, what="running at the engine")
        threads += [sent(f"batch-{n}", 2 + n, 20, "batch", 2 + n) for n in range(BATCH)]
        threads.append(sent("interactive", 9, 1, "interactive", 2 + BATCH))
        for thread in threads:
            thread.join(30)

    assert finished[0] == "running"
    assert finished.index("interactive") == (1 if engine_priority else 1 + BATCH), finished
