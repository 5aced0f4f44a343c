"""The A/B's engine hit rate end to end: over a fleet that reports cached prompt tokens in its usage
(--enable-prompt-tokens-details), /admin/ab shows, for each policy, what the engines found cached beside what
the router predicted, from whole answers and from streams' usage chunks alike."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvroute.processes import FleetPorts, running_fleet, running_router
from kvroute.workload import AgentWorkload
from tests.router.http.test_admin import AUTH, call, config_of
from tests.support.http import post

WORKLOAD = AgentWorkload(system_prompt_words=300, min_turn_words=40, max_turn_words=80, max_tokens=4)
POLICIES = ("round-robin", "kvroute")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ports = FleetPorts.allocate(2)
    tmp = tmp_path_factory.mktemp("ab-engine-hits")
    args = ["--prefill-tps", "200000", "--decode-tps", "1000", "--enable-prompt-tokens-details"]
    with running_fleet(ports, tmp / "fleet", args), running_router(config_of(ports), tmp / "router") as url:
        yield url


def _turns(url: str, policy: str, session: int) -> None:
    """Three turns of one session, every other one streamed with its usage."""
    messages = [{"role": "system", "content": WORKLOAD.system_prompt()}]
    for turn in range(3):
        messages.append({"role": "user", "content": WORKLOAD.user_message(session, turn)})
        stream = {"stream": True, "stream_options": {"include_usage": True}} if (session + turn) % 2 else {}
        body = {"model": "tiny-llama", "messages": messages, "max_tokens": WORKLOAD.max_tokens, **stream}
        headers = {"x-session-id": f"{policy}-{session}", "x-kvroute-policy": policy}
        status, _, payload = post(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
        assert status == 200, payload
        messages.append({"role": "assistant", "content": "ok"})


def test_each_policy_reports_the_engines_hits_beside_its_predicted_ones(router: str) -> None:
    for policy in POLICIES:
        for session in range(4):
            _turns(router, policy, session)
    status, report = call("GET", router + "/admin/ab", headers=AUTH)
    assert status == 200
    for policy in POLICIES:
        results = report["policies"][policy]
        assert results["requests"] == 12
        # every answer, whole or streamed, reported its cached tokens
        assert results["observed_prompt_tokens"] == results["prompt_tokens"] > 0
        assert 0 < results["observed_cached_tokens"] < results["observed_prompt_tokens"]
        # requests one at a time: the router's index knew what each engine held
        assert results["observed_cached_tokens"] == results["predicted_cached_tokens"], policy
