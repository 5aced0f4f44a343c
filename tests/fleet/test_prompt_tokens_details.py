"""The fleet's usage.prompt_tokens_details against real vLLM 0.32's with --enable-prompt-tokens-details
(tests/fixtures/vllm/prompt_tokens_details_capture.json, scripts/capture_vllm_usage.py).

Every captured request (per endpoint and mode a prompt, the prompt extended, the prompt again) is replayed in
order against one simulated instance with the captured block size; the same tokenizer gives the same prompt
lengths, so the usage must be equal, cached and created tokens included, and the bodies alike key for key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import FleetPorts, running_fleet
from tests.fleet.layout import key_paths, sse_chunks
from tests.fleet.test_vllm_fidelity import _request

CAPTURE = json.loads(
    (
        Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "prompt_tokens_details_capture.json"
    ).read_text()
)
RECORDED = {r["name"]: r for r in CAPTURE["requests"]}
ENGINE_ARGS = [
    "--block-size",
    str(CAPTURE["block_size"]),
    "--max-model-len",
    "4096",
    "--prefill-tps",
    "1000000",
    "--decode-tps",
    "5000",
    "--enable-prompt-tokens-details",
]


def _completion_tokens(recorded: dict[str, Any]) -> int:
    if "response" in recorded:
        return int(recorded["response"]["usage"]["completion_tokens"])
    return int(sse_chunks(recorded["sse"])[-1]["usage"]["completion_tokens"])


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Each request's answer: the body, or a stream's chunks."""
    ports, answers = FleetPorts.allocate(1), {}
    with running_fleet(ports, tmp_path_factory.mktemp("details-fleet"), ENGINE_ARGS):
        for name, recorded in RECORDED.items():
            # as many tokens as real vLLM generated (it may have hit EOS)
            body = {**recorded["request"], "max_tokens": _completion_tokens(recorded)}
            status, _, payload = _request(f"http://127.0.0.1:{ports.http}{recorded['path']}", "POST", body)
            assert status == recorded["status"] == 200, name
            answers[name] = sse_chunks(payload.decode()) if body.get("stream") else json.loads(payload)
    yield answers


@pytest.mark.parametrize("name", [n for n, r in RECORDED.items() if "response" in r])
def test_whole_answers_match_vllm(replayed: dict[str, Any], name: str) -> None:
    real = RECORDED[name]["response"]
    assert replayed[name]["usage"] == real["usage"]
    assert key_paths(replayed[name]) == key_paths(real)


@pytest.mark.parametrize("name", [n for n, r in RECORDED.items() if "sse" in r])
def test_stream_usage_chunks_match_vllm(replayed: dict[str, Any], name: str) -> None:
    real = sse_chunks(RECORDED[name]["sse"])
    assert replayed[name][-1]["usage"] == real[-1]["usage"]
    assert [key_paths(c) for c in replayed[name]] == [key_paths(c) for c in real]


@pytest.mark.parametrize("case", ["chat", "chat_stream", "completion", "completion_stream"])
def test_a_repeated_prompt_reports_its_cached_blocks(replayed: dict[str, Any], case: str) -> None:
    def details(step: str) -> dict[str, Any]:
        answer = replayed[f"{case}.{step}"]
        usage = answer[-1]["usage"] if isinstance(answer, list) else answer["usage"]
        return {"prompt_tokens": usage["prompt_tokens"], **usage["prompt_tokens_details"]}

    first, again = details("first"), details("again")
    assert first["cached_tokens"] == 0
    block = CAPTURE["block_size"]
    # all its blocks but the one holding the last token, which vLLM computes again for its logits
    assert again["cached_tokens"] == (again["prompt_tokens"] - 1) // block * block > 0
    assert details("extended")["cached_tokens"] > 0
