"""The engine profile: fitted to what was measured, written and loaded, and what `bench simulate --profile`
runs the fleet with."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kvroute.bench.calibrate.check import check_trace, compare, simulated_run, simulated_ttfts
from kvroute.bench.calibrate.fit import Measured, fit
from kvroute.bench.calibrate.run import OMP_BIND, engines_config
from kvroute.cli import main
from kvroute.simulate.hardware import EngineSpec, FleetSpec
from kvroute.simulate.profile import Profile, load_profile

TRUE = replace(
    EngineSpec(),
    prefill_tokens_per_s=40_000.0,
    decode_step_s=0.004,
    decode_step_s_per_seq=0.0005,
    frontend_s=0.01,
    frontend_s_per_token=2e-6,
    kv_blocks=5_000,
    block_size=32,
    max_num_seqs=128,
    max_batched_tokens=2048,
)


LENGTHS = (32, 512, 1024, 2048, 3072, 4000)


def _measured(engine: EngineSpec) -> Measured:
    """What an engine that behaves exactly as the model says would show the probes."""
    return Measured(
        prefill_ttft_s={n: engine.prefill_s(0, n) for n in LENGTHS},
        cached_ttft_s={n: engine.prefill_s(n - 1, 1) for n in LENGTHS},
        decode_step_s={b: engine.decode_step_s + b * engine.decode_step_s_per_seq for b in (1, 4, 8)},
        kv_blocks=engine.kv_blocks,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_batched_tokens=engine.max_batched_tokens,
    )


def test_the_fit_recovers_the_engine_the_measurements_came_from() -> None:
    fitted = fit(_measured(TRUE))
    fields = (
        "prefill_tokens_per_s",
        "decode_step_s",
        "decode_step_s_per_seq",
        "frontend_s",
        "frontend_s_per_token",
    )
    for name in fields:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert (fitted.kv_blocks, fitted.block_size, fitted.max_batched_tokens) == (5_000, 32, 2048)


def test_a_profile_is_loaded_as_written_and_a_bad_one_is_named(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    Profile(TRUE, "by hand", asdict(_measured(TRUE)), {"requests": 1}).write(path)
    loaded = load_profile(path)
    assert loaded.engine == TRUE and loaded.source == "by hand" and loaded.check == {"requests": 1}
    document = json.loads(path.read_text())
    document["engine"]["warp_drive"] = 1
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="warp_drive"):
        load_profile(path)


def test_the_simulator_runs_a_fleet_of_the_profiles_engines(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    Profile(TRUE, "by hand").write(path)
    out = tmp_path / "out"
    arguments = ["bench", "simulate", "--profile", str(path), "--requests", "30", "--policies", "kvroute"]
    assert main([*arguments, "--out", str(out)]) == 0
    setup = json.loads((out / "results.json").read_text())["setup"]
    assert setup["engine"]["prefill_tokens_per_s"] == 40_000.0 and setup["engine"]["frontend_s"] == 0.01
    (tmp_path / "bad.json").write_text("{}")
    assert main(["bench", "simulate", "--profile", str(tmp_path / "bad.json"), "--out", str(out)]) == 2


def test_the_check_simulates_the_fixed_trace_and_measures_each_requests_error() -> None:
    trace = check_trace()
    assert all(r.input_tokens + r.output_tokens <= 4096 for r in trace.requests)
    run = simulated_run(FleetSpec(instances=1, engine=TRUE, pool=None), trace, [0] * len(trace.requests))
    simulated = simulated_ttfts(run)
    assert len(simulated) == len(trace.requests) and all(t > 0 for t in simulated)
    checked = compare([2 * t for t in simulated], simulated)
    assert checked["ttft_median_error"] == pytest.approx(0.5)
    assert not math.isnan(checked["ttft_p90_error"])


def test_the_pool_checks_engines_each_get_a_core_of_their_own_and_a_lone_engine_keeps_the_stacks() -> None:
    stack = Path(__file__).resolve().parents[3] / "configs" / "stack-cpu.yaml"
    alone = engines_config(stack, pool=False)
    assert alone.vllm.instances == 1 and not alone.vllm.per_instance and alone.pool is None
    pooled = engines_config(stack, pool=True)
    cores = sorted(os.sched_getaffinity(0))
    assert pooled.vllm.instances == 2 and pooled.pool is not None
    if len(cores) < 2:
        assert not pooled.vllm.per_instance  # one core: nothing to give each its own
        return
    bound = [pooled.vllm.instance(n).env[OMP_BIND] for n in range(2)]
    assert bound == [str(cores[0]), str(cores[1])]
