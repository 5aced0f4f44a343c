"""Agent sessions in each API through kvroute in front of the simulated fleet: the same conversations give
the prompts vLLM 0.32 would count for them, and a chain of stored responses stays where it is stored."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.agent_apis import Api
from kvroute.agent_sessions import SessionPlan, TurnOutcome, run_sessions
from kvroute.workload import AgentWorkload
from router.dispatch.observe.routing_headers import POLICY_HEADER

SESSIONS, TURNS = 2, 3


def _sessions(router_url: str, api: Api, chain: bool = False, policy: str = "") -> list[TurnOutcome]:
    """One session at a time, so the outcomes are in session and turn order."""
    workload = AgentWorkload(sessions=SESSIONS, turns=TURNS, max_tokens=4, system_prompt_words=120, seed=7)
    plan = SessionPlan(
        workload,
        "tiny-llama",
        concurrency=1,
        api=api,
        responses_chain=chain,
        session_prefix=api,
        headers={POLICY_HEADER: policy} if policy else {},
    )
    outcomes = asyncio.run(run_sessions(router_url, plan)).outcomes
    assert [o.status for o in outcomes] == ["ok"] * SESSIONS * TURNS, [o.error for o in outcomes]
    assert all(0 < o.ttft_s <= o.e2e_s for o in outcomes)
    return outcomes


def _per_session(outcomes: list[TurnOutcome]) -> list[list[TurnOutcome]]:
    return [outcomes[i : i + TURNS] for i in range(0, len(outcomes), TURNS)]


@pytest.fixture(scope="module")
def chat(router_url: str) -> list[TurnOutcome]:
    return _sessions(router_url, "chat")


def test_messages_are_chat_token_for_token(router_url: str, chat: list[TurnOutcome]) -> None:
    """vLLM serves a Messages body as the chat it converts to: the same prompts, so the same (greedy)
    replies, so the same prompts every turn."""
    messages = _sessions(router_url, "messages")
    assert [o.prompt_tokens for o in messages] == [o.prompt_tokens for o in chat]
    for session in _per_session(messages):
        prompts = [o.prompt_tokens for o in session]
        assert prompts == sorted(prompts) and len(set(prompts)) == TURNS  # the history grows every turn


def test_responses_tokenize_with_special_tokens(router_url: str, chat: list[TurnOutcome]) -> None:
    """A Responses prompt is the chat template's text tokenized with add_special_tokens: the tiny model's
    BOS twice, one token more than chat (research doc §0.1). Later turns hold other (greedy) replies."""
    responses = _sessions(router_url, "responses")
    firsts = [session[0].prompt_tokens for session in _per_session(responses)]
    assert firsts == [session[0].prompt_tokens + 1 for session in _per_session(chat)]


def test_a_chain_of_stored_responses_is_the_whole_history(router_url: str) -> None:
    """Each turn sends only its new input after previous_response_id: the instance that stored the response
    renders the same prompt as the whole history, and only it can, so a round robin that moves every
    whole-history turn sends every chained one there."""
    whole = _sessions(router_url, "responses", policy="round-robin")
    chained = _sessions(router_url, "responses", chain=True, policy="round-robin")
    assert [o.prompt_tokens for o in chained] == [o.prompt_tokens for o in whole]
    for moved, pinned in zip(_per_session(whole), _per_session(chained), strict=True):
        assert len({o.instance for o in moved}) == TURNS, moved
        assert len({o.instance for o in pinned}) == 1 and pinned[0].instance, pinned
