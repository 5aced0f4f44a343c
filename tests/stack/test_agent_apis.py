"""The agents' own APIs through kvroute to real vLLM engines, driven by the official SDKs (issue 41): the
same conversations as tests/scenarios/test_agent_sdks.py, where the engines' prefix hits are vLLM's own.

configs/stack-cpu.yaml has the engines store responses (VLLM_ENABLE_RESPONSES_API_STORE=1), take tools
(--enable-auto-tool-choice, a tool-call parser) and say what they found cached (--enable-prompt-tokens-details).
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from kvroute.stack.run import VLLM_STOP_TIMEOUT_S, Stack
from tests.scenarios.test_agent_sdks import (
    INSTANCE_HEADER,
    MAX_OUTPUT,
    MODEL,
    TURNS,
    assert_one_instance_predicted_exactly,
    check_background_cancel,
    check_create_stream_retrieve,
    check_follow_up_not_found,
    check_messages_create_stream_count,
    messages_conversation,
    responses_chain,
    settled,
    whole_response,
)
from tests.stack.client import POLICY_HEADER

pytestmark = pytest.mark.stack

TIMEOUT_S = 120  # two engines, the master and the router share two cores
# llm-d's prefix profile, where the prefix held outweighs load: the default's predicted TTFT may rightly
# send a turn to the other engine, which can load the prefix from the pool (tests/stack/test_local_prediction.py)
PREFIX_FIRST = {POLICY_HEADER: "precise-prefix"}


def openai_client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.router_url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT_S,
        default_headers=PREFIX_FIRST,
    )


def anthropic_client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=stack.router_url,
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT_S,
        default_headers=PREFIX_FIRST,
    )


def test_responses_create_stream_and_retrieve(stack: Stack) -> None:
    check_create_stream_retrieve(openai_client(stack))


def test_responses_chain_stays_on_one_instance_with_predicted_hits(stack: Stack) -> None:
    assert_one_instance_predicted_exactly(
        responses_chain(openai_client(stack), TURNS, settled(stack.router_url, quiet_s=1.0))
    )


def test_responses_background_cancel(stack: Stack) -> None:
    check_background_cancel(openai_client(stack))


def test_unknown_response_id_is_not_found(stack: Stack) -> None:
    check_follow_up_not_found(openai_client(stack), "resp_nope")


def test_messages_create_stream_and_count_tokens(stack: Stack) -> None:
    check_messages_create_stream_count(anthropic_client(stack))


def test_messages_conversation_with_tools_stays_on_one_instance_with_predicted_hits(stack: Stack) -> None:
    assert_one_instance_predicted_exactly(
        messages_conversation(anthropic_client(stack), TURNS, settled(stack.router_url, quiet_s=1.0))
    )


def test_stopped_holder_gives_not_found(stack: Stack) -> None:
    """While the engine that stored a response is down, a follow-up gets vLLM's 404 from the router; once
    it is back (its memory empty), from the engine itself."""
    client = openai_client(stack)
    stored, headers = whole_response(
        client, model=MODEL, input="Remember this.", max_output_tokens=MAX_OUTPUT
    )
    index = next(i for i, instance in enumerate(stack.instances) if instance.name == headers[INSTANCE_HEADER])
    stack.children[stack.instances[index].name].stop(VLLM_STOP_TIMEOUT_S)
    try:
        check_follow_up_not_found(client, stored.id)
    finally:
        stack.restart_vllm(index)
    check_follow_up_not_found(client, stored.id)
