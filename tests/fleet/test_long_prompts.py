"""A simulated instance tokenizes a long prompt off its event loop, as vLLM's API server does on a thread of
its own: its fleet's other instances, which share the process and the loop, keep answering meanwhile."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.processes import FleetPorts, running_fleet
from tests.support.http import post
from tests.support.responsiveness import probed_while

WORDS = "alpha beta gamma delta run tests fix the bug".split()


def test_an_instance_answers_while_another_tokenizes_a_megabyte_chat(tmp_path: Path) -> None:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(250_000))  # 1.2 MB, past the model's context
    large = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": text}]}).encode()
    small = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}).encode()
    ports = FleetPorts.allocate(2)
    with running_fleet(ports, tmp_path):
        first, second = (f"http://127.0.0.1:{ports.http + i}" for i in range(2))

        def answered() -> None:
            assert post(second + "/v1/completions", small)[0] == 200

        (status, _, payload), probed = probed_while(
            answered, lambda: post(first + "/v1/chat/completions", large)
        )
    assert status == 400 and b"maximum context length" in payload, payload  # tokenized, then refused
    assert probed.took_s > 0.3 and len(probed.waits_s) > 3  # the check below saw the tokenization
    # On the loop, the other instance's answers waited for all of it.
    assert probed.longest_s < probed.took_s / 2, (probed.longest_s, probed.took_s)
