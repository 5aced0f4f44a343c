"""The published H100 / Llama-3.1-8B engine profile (configs/profiles/): every engine field says where it comes
from, the profile lands near the published figures it was not fitted to, and a fleet of its engines runs."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.hardware import EngineSpec, FleetSpec
from kvroute.simulate.policies import SimPolicy
from kvroute.simulate.profile import Profile, load_profile
from kvroute.simulate.results import RunResult
from kvroute.simulate.simulation import simulate
from kvroute.traces import Trace, TraceRequest

PROFILE = Path(__file__).parents[3] / "configs" / "profiles" / "h100-llama-3.1-8b.json"


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE)


class _OneInstance(SimPolicy):
    name = "one-instance"

    def route(self, request: object) -> int:
        return 0


def _alone(engine: EngineSpec, requests: list[TraceRequest]) -> RunResult:
    """The requests on one instance of the engine, no pool."""
    blocks = TraceBlocks(Trace("published", 512, tuple(requests)), engine.block_size)
    result = simulate(blocks, FleetSpec(1, engine, None), _OneInstance(), ideal_hit_rate=0.0)
    assert result.completed == len(requests) and result.preemptions == 0
    return result


def test_every_engine_field_names_a_source_or_says_it_is_derived(profile: Profile) -> None:
    sources = profile.measured["sources"]
    assert set(sources) == {f.name for f in fields(EngineSpec)}
    for name, value in asdict(profile.engine).items():
        entry = sources[name]
        assert entry["value"] == value, name
        assert str(entry.get("url", "")).startswith("https://") or entry.get("derived"), name
    assert "H100" in profile.source and "published" in profile.source


def test_the_profile_lands_near_the_published_figures_it_was_not_fitted_to(profile: Profile) -> None:
    engine, check = profile.engine, profile.check

    prompts = [TraceRequest(0.0, 512, 1, (n,)) for n in range(160)]
    batched = _alone(engine, prompts).throughput_rps * 512
    figure = check["batched_prefill_tokens_per_s"]
    assert batched == pytest.approx(figure["profile"], rel=0.01)
    assert batched == pytest.approx(figure["published"], rel=0.1)

    figure = check["single_request_ttft_s"]
    ttft = [engine.prefill_s(0, tokens) for tokens in figure["prompt_tokens"]]
    assert ttft == pytest.approx(figure["profile_s"], rel=0.01)
    assert ttft == pytest.approx(figure["published_s"], rel=0.1)

    # The published run varied its lengths by 15% and the simulator prices a decode run at the contexts it
    # starts with: a looser bound.
    turns = [
        TraceRequest(0.0, 20_000, 2_000, tuple(range(100 * n, 100 * n + 40)), f"session-{n % 8}")
        for n in range(24)
    ]
    itl = _alone(engine, turns).itl_p50_s
    figure = check["itl_concurrency_8_s"]
    assert itl == pytest.approx(figure["profile"], rel=0.01)
    assert itl == pytest.approx(figure["published"], rel=0.15)


def test_a_fleet_of_its_engines_runs_an_agentic_trace(profile: Profile, tmp_path: Path) -> None:
    arguments = ["bench", "simulate", "--trace", "agentic", "--sessions", "3", "--requests", "40"]
    arguments += ["--policies", "kvroute", "--profile", str(PROFILE), "--out", str(tmp_path)]
    assert main(arguments) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["setup"]["engine"] == asdict(profile.engine)
    kvroute = results["policies"]["kvroute"]
    assert kvroute["completed"] == 40 and kvroute["rejected"] == 0
    assert kvroute["ttft_p50_s"] > 0
    assert kvroute["itl_p50_s"] >= profile.engine.decode_step_s  # no step is shorter than its fixed cost
