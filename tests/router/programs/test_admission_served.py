"""Admission by program through the proxy: a new program waits in the router while a program in its tool
call holds the instance's KV cache, that program's next turn does not wait behind it, and the new program
goes once the tool call's time-to-live lapses."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from kvroute.processes import FleetPorts, running_fleet, running_router
from tests.conftest import metric, sample
from tests.support.http import get_json, post
from tests.support.waiting import eventually


def complete(url: str, session: str, prompt: list[int], answers: list[int]) -> None:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}
    status, _, payload = post(url + "/v1/completions", json.dumps(body).encode(), {"x-session-id": session})
    answers.append(status)
    assert status == 200, payload


def waiting(url: str, kind: str) -> float:
    return sample(url, "kvroute_programs_waiting", kind=kind) or 0.0


def test_a_new_program_waits_for_the_kv_a_program_in_its_tool_call_holds(tmp_path: Path) -> None:
    """One instance of 16 blocks of 32 tokens (512); a new program may start while the working sets and its
    prompt stay under 0.9 of that (460): two programs of 300 tokens do not fit together."""
    ports = FleetPorts.allocate(1)
    with running_fleet(ports, tmp_path, ["--kv-blocks", "16"]):
        config = ports.router_config(programs={"start_below": 0.9, "ttl_prior_s": 5.0, "max_wait_s": 30.0})
        with running_router(config, tmp_path) as url:
            eventually(
                lambda: get_json(url + "/dashboard/state")["instances"][0]["kv_capacity_tokens"] == 512
            )
            answers: list[int] = []
            complete(url, "agent-a", [5] * 300, answers)  # answered: agent-a runs its tool, its KV counted
            second = threading.Thread(target=complete, args=(url, "agent-b", [6] * 300, answers))
            second.start()
            eventually(lambda: waiting(url, "new") == 1)
            complete(url, "agent-a", [5] * 300 + [7] * 20, answers)  # agent-a's next turn goes at once
            assert second.is_alive() and waiting(url, "new") == 1
            state = get_json(url + "/dashboard/state")
            assert state["programs_waiting"] == {"back": 0, "new": 1}
            second.join(timeout=30)  # agent-a's time-to-live lapses: its room is agent-b's
            assert not second.is_alive() and answers == [200, 200, 200]
            assert waiting(url, "new") == 0
            assert metric(url, "kvroute_program_wait_seconds_count", kind="new") == 1
            complete(url, "agent-c", [8] * 100, answers)  # beside agent-b's 300, 100 fit: it does not wait
            assert metric(url, "kvroute_program_wait_seconds_count", kind="new") == 1
