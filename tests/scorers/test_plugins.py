"""The extension points (scorers/plugins.py): a policy finds a plugin's hooks by its methods and calls them
in order: scores, the pick, the explainers (before the choice counts), the observers, and after a response."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from scorers import registry
from scorers.candidate import Candidate
from scorers.params import Params, Registration
from scorers.policy import Policy
from scorers.policy_config import PolicyConfig, ScorerSpec
from scorers.request import RoutingRequest
from tests.scorers.candidates import Fake


class _Recorder:
    """Prefers the candidate named "b"; records each hook as it is called."""

    def __init__(self, params: Params) -> None:
        self.calls: list[str] = []

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        self.calls.append("score")
        return [1.0 if c.name == "b" else 0.0 for c in candidates]

    def explain(self, request: RoutingRequest, candidates: int, chosen: Candidate) -> Mapping[str, float]:
        self.calls.append(f"explain {chosen.name} of {candidates}")
        return {"picked_b": float(chosen.name == "b")}

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None:
        self.calls.append(f"observe {chosen.name}")

    def responded(
        self, request: RoutingRequest, chosen: Candidate, ttft_s: float | None, status: int
    ) -> None:
        self.calls.append(f"responded {chosen.name} {ttft_s} {status}")


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Policy:
    monkeypatch.setitem(registry.SCORERS, "recorder", Registration(Params, _Recorder))
    return Policy("p", PolicyConfig(scorers=[ScorerSpec(type="recorder")]))


def test_a_pick_is_explained_before_it_is_observed(recorder: Policy) -> None:
    request = RoutingRequest(model="m")
    pick = recorder.pick(request, [Fake("a"), Fake("b")])
    recorder.responded(request, Fake("b"), 0.25, 200)
    (plugin,) = (scorer for scorer, _ in recorder._scorers)
    assert isinstance(plugin, _Recorder)
    assert pick.index == 1 and pick.explained == {"picked_b": 1.0}
    assert plugin.calls == ["score", "explain b of 2", "observe b", "responded b 0.25 200"]


def test_a_policy_without_explainers_explains_nothing() -> None:
    policy = Policy("p", PolicyConfig(scorers=[ScorerSpec(type="round-robin")]))
    assert policy.pick(RoutingRequest(model="m"), [Fake("a"), Fake("b")]).explained == {}


def test_an_unknown_plugin_type_is_refused_as_the_policy_is_read() -> None:
    with pytest.raises(ValueError, match="unknown scorer type 'magic'"):
        PolicyConfig(scorers=[ScorerSpec(type="magic")])
