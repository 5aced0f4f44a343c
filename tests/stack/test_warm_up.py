"""A program's next turn warmed up through the real stack: once a turn is answered where its policy would not
send the next one, the router has the other instance load the prompt from the Mooncake pool while the tool
runs (programs.warm_up; router/dispatch/place/warm_up.py).

A router of the test's own, with warm-ups on, stands beside the stack's. Round robin
(`x-kvroute-policy: round-robin`) scores every instance alike, so it foresees every next turn at the first
instance: a turn answered by the second is foreseen to move.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import running_router
from kvroute.stack.run import Stack
from tests.conftest import sample
from tests.stack.client import INSTANCE_HEADER, MODEL, POLICY_HEADER, metric, post, random_tokens, wait_steady
from tests.support.http import get_json
from tests.support.waiting import eventually, within

pytestmark = pytest.mark.stack

PROMPT_TOKENS = 1_000
MOVED_TURNS = 3  # given the chance of a warm-up
# Long enough an answer that the prompt's blocks are in the pool, and announced, by its end
ANSWER_TOKENS = 48


def turn(url: str, session: str, prompt: list[int]) -> str:
    """The instance that answered the program's turn."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": ANSWER_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    headers = {POLICY_HEADER: "round-robin", "x-session-id": session}
    return post(url + "/v1/completions", body, headers).headers[INSTANCE_HEADER]


def test_a_turn_answered_where_the_next_is_not_foreseen_is_warmed_up_from_the_pool(
    stack: Stack, tmp_path: Path
) -> None:
    if stack.master_url is None:
        pytest.skip("the stack runs without the pool")
    config = stack.plan.router_config()
    config["programs"] = {**config.get("programs", {}), "warm_up": True}
    foreseen = stack.instances[0]
    with running_router(config, tmp_path, "warm-up-router") as url:
        eventually(lambda: all(i["healthy"] for i in get_json(url + "/dashboard/state")["instances"]))
        rng = random.Random(11)
        hits_before = wait_steady(lambda: metric(foreseen.url, "vllm:external_prefix_cache_hits_total"))
        warm_ups = lambda: sample(  # noqa: E731
            url, "kvroute_program_warm_ups_total", vllm_instance=foreseen.name, reason="moves"
        )
        moved = 0
        # Round robin: one of two turns is answered by the other instance. A warm-up goes only once the pool
        # holds the prompt when its turn is answered: on two busy cores, the connector's saves can come later,
        # so a few turns that moved are given the chance.
        for number in range(12):
            if turn(url, f"agent-{number}", random_tokens(rng, PROMPT_TOKENS)) == foreseen.name:
                continue
            moved += 1
            if within(warm_ups, timeout_s=10) or moved == MOVED_TURNS:
                break
        assert moved, "round robin sent no turn to the second instance"
        assert warm_ups(), f"no warm-up at the instance foreseen after {moved} turns that moved"
        # It loaded the prompt's blocks from the pool (a computed prompt would be no external hit)
        eventually(
            lambda: metric(foreseen.url, "vllm:external_prefix_cache_hits_total") > hits_before,
            what="the warm-up's prompt loaded from the pool",
        )
