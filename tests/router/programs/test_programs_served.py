"""A session's turns through the router, as an agent sends them: the router follows them as one program,
counts its KV at its instance through the tool call, and tells that the next turn found it there."""

from __future__ import annotations

import json
import time

from tests.conftest import metric, sample
from tests.support.http import post
from tests.support.waiting import eventually

MODEL = "tiny-llama"
SYSTEM = "You are a coding agent. Read the failing test, find the bug, fix it and run the tests again. " * 8


def chat(router_url: str, session: str, messages: list[dict[str, str]]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    status, headers, payload = post(
        router_url + "/v1/chat/completions", json.dumps(body).encode(), {"x-session-id": session}
    )
    assert status == 200, payload
    return headers["x-kvroute-instance"]


def turns(router_url: str, kv: str, tool_call: str) -> float:
    return sample(router_url, "kvroute_program_turns_total", kv=kv, tool_call=tool_call) or 0.0


def test_an_agents_next_turn_is_told_to_have_found_its_kv_at_its_instance(router_url: str) -> None:
    session = f"program-{time.monotonic_ns()}"
    first_turns, kept = turns(router_url, "first", "none"), turns(router_url, "kept", "within_ttl")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix tests/test_io.py."}]
    stored = sample(router_url, "kvroute_kv_events_total", type="BlockStored") or 0.0
    instance = chat(router_url, session, messages)
    assert turns(router_url, "first", "none") == first_turns + 1
    # The turn is over (its answer relayed), its blocks announced: the program runs its tool.
    eventually(lambda: metric(router_url, "kvroute_programs", vllm_instance=instance, state="tool_call") >= 1)
    eventually(lambda: metric(router_url, "kvroute_kv_events_total", type="BlockStored") > stored)
    assert metric(router_url, "kvroute_program_working_set_tokens", vllm_instance=instance) > 0
    messages += [
        {"role": "assistant", "content": "Running the tests."},
        {"role": "user", "content": "2 passed, 1 failed: test_read_empty."},
    ]
    assert chat(router_url, session, messages) == instance  # the session stays where its context is
    assert turns(router_url, "kept", "within_ttl") == kept + 1
    assert metric(router_url, "kvroute_program_tool_call_seconds_count") >= 1
